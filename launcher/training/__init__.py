"""One training run: a resolved run -> the loop (:mod:`.loop`: accumulation, clipping, the schedule of
:mod:`.schedule`, eval, the OOM ladder) -> the run directory (:mod:`.rundir`: metrics, summary, final weights),
checkpoints that survive kills and damage (:mod:`.checkpoint`), the memory monitor (:mod:`.monitor`), per-step
output (:mod:`.progress`), trackers (:mod:`.tracking`), signals and injected faults (:mod:`.faults`), a sample
after training (:mod:`.generate`) and the pictures (:mod:`.plots`)."""
