"""One training run: a resolved run -> its start (:mod:`.prepare`: decided, data loaded, the run directory claimed and
the checkpoint it continues restored by :mod:`.resume`, the engine built) -> the loop (:mod:`.loop`: accumulation,
clipping, the schedule of :mod:`.schedule`, eval of :mod:`.evaluation`, the OOM ladder) -> its end (:mod:`.finish`:
final weights, summary), all around one record (:mod:`.state`); the run directory (:mod:`.rundir`: metrics, summary,
final weights), checkpoints that survive kills and damage (:mod:`.checkpoint`), the memory monitor (:mod:`.monitor`),
per-step output (:mod:`.progress`), trackers (:mod:`.tracking`), signals and injected faults (:mod:`.faults`), a
sample after training (:mod:`.generate`) and the pictures (:mod:`.plots`)."""
