"""`jddp-run`'s implementation: the rank processes (`procs`), one attempt's watch (`watch`), the
agent that runs attempts, restarts and nodes (`agent`), and the command line (`cli`)."""
