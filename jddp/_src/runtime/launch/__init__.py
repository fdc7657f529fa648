"""`jddp-run`'s implementation: the rank processes (`procs`), one attempt's watch (`watch`), the
agent that runs attempts, restarts and nodes (`agent`), the command line (`cli`), and
`--islands` (`islands`)."""
