"""A discrete-event simulator of the serving graph that drives the real router and policies
(plain Python: no Ray, no torch). `server.SimServer` walks requests through simulated engines
(`engine.SimEngine`: the real scheduler and block manager, steps timed by `steptime.StepTime`),
`workload.Workload` makes the traffic, `report.summarize` the figures; scripts/simulate.py runs it."""
