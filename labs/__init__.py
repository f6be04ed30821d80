"""Labs: benchmark harnesses, network-namespace builders, fault-injecting proxies and other
test doubles that exercise Echo from outside.

Nothing in the runtime packages (echo, learner, worker, broadcast, dataplane, adapters,
provisioning) imports from here; labs import the runtime. The package is not part of the wheel a
volunteer installs: benchmarks and tests run it from a checkout (pytest puts the repository root
on sys.path, see ``pythonpath`` in pyproject.toml; scripts run as ``python -m labs.<name>``).
"""
