"""kopf handler modules: each module of this package registers its handlers when imported.

The runtime imports every module here (`cacheroute.operator.runtime.load_handlers`), so a new
concern plugs in by adding a module. Handlers stay thin: they gather what kopf hands them and
call the code in `cacheroute.operator.fleet` / `cacheroute.operator.control`.
"""
