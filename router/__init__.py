"""The data plane: an Envoy ext_proc endpoint picker that follows the planned affinity table.

It speaks the Gateway API Inference Extension endpoint-picker protocol, so any GIE gateway (or a
plain Envoy with an ORIGINAL_DST cluster) can use it. Only the plan format is imported from the
planner; the router never talks to the operator.
"""
