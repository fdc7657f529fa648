"""The job around the step: mesh, topology, launchers, processes, watchdog, preemption."""
