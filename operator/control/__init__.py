"""The AffinityPlan control loop: metrics window → planner → guard → plan ConfigMaps → status.

`loop.PlanLoop` runs one period; the modules behind it hold one concern each: `promql` and
`prometheus` (reading the window), `inputs` (the planner's statistics, destinations, settings),
`guard` (shadow replay), `plans` and `publish` (the plan ConfigMaps), `conditions`, `metrics`,
`kube` (API calls). kopf drives it from `cacheroute.operator.handlers.plan`.
"""
