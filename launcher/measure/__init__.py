"""Real steps that measure this machine or a setting; only the CLI imports this package. The machine's speeds
for the step-time model (:mod:`.calibrate`, :mod:`.stepcal`: ``vramfit doctor --calibrate``), the same workload
under several profiles (:mod:`.bench`: ``vramfit bench``), and the planner's best few settings measured and
learned from (:mod:`.tune`: ``vramfit tune``)."""
