"""Real steps that measure this machine or a setting; only the CLI imports this package. The machine's speeds
for the step-time model (``vramfit doctor --calibrate``): :mod:`.calibrate` runs the calibration (the device's
rates, copies, optimizers, disk), :mod:`.engine_costs` the engines' fixed costs, :mod:`.stepcal` the rates inside
real steps, all timed the way :mod:`.timing` times things; the result is cached by :mod:`launcher.machine.speeds`.
The same workload under several profiles (:mod:`.bench`: ``vramfit bench``), and the planner's best few settings
measured and learned from (:mod:`.tune`: ``vramfit tune``)."""
