"""A load generator that replays a workload as real OpenAI-style HTTP requests.

`schedule.load_schedule` turns a Mooncake trace or a generated workload into timed requests;
`prompts` builds prompt text in which the trace's prefix blocks become shared text (so a prefix
cache sees exactly the trace's reuse); `client.run_load` sends them open-loop and measures each
one client side; `report` summarises and writes JSON or CSV. `cacheroute sandbox load` is the
command line.
"""
