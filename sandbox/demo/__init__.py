"""`make demo`: the whole loop on one machine, a p2c phase then a planned phase of the same traffic.

The sandbox (control plane, fake H100 nodes, Prometheus, the pod runtime) runs the chart's
operator, the pool's vLLM emulators and its router; the load generator sends the workload through
the router's Envoy; the operator plans from Prometheus and publishes to the router. Modules by
concern: `settings` (the full and short runs), `workload` (the traffic of both phases),
`cluster` (helm install, the example manifests, readiness), `observe` (counters read back from
Prometheus and the routers), `phases` (one phase of traffic, the switch to Auto), `prediction`
(the shadow replay of the same run), `report` and `plots` (what is printed and drawn), `run`
(the sequence), `cli` (`cacheroute sandbox demo`).
"""
