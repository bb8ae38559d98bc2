"""A vLLM stand-in for the sandbox: vLLM's HTTP API and metrics, the replay engine's timing.

`EmulatorConfig` comes from a pod's own `vllm serve` arguments (`args.parse_vllm_args`);
`Emulator` serves one pod on its IP and port; many emulators share one asyncio loop (the pod
runtime hosts them all in one process). The engine behind every emulator is the shadow replay's
`planner.replay.engine.Engine`, advanced on the event loop's clock, so what a request costs here
is what it costs in the replay.
"""
