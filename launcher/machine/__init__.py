"""What this machine is, read before anything is loaded: the hardware probe (GPUs, RAM, pinned-memory limit,
DeepSpeed and its ops; :mod:`.hardware`) -> the threads a run uses (:mod:`.threads`) and the room for its checkpoints
on disk (:mod:`.diskspace`) and the heap that gives freed tensors back (:mod:`.heap`); the launcher's ranks and
process groups (:mod:`.dist`). The speeds this machine was measured at are kept in the cache (:mod:`.speeds`),
checked again in well under a second before a plan is priced with them (:mod:`.recheck`) and read by
:mod:`launcher.plan.steptime`; :mod:`launcher.measure` measures them."""
