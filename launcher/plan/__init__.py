"""Decisions before anything is loaded, pure (no engine, no loop, no measuring, no logging), entered by one front
door (:mod:`.decide`, which also measures ``memory.nvme_path`` and rechecks the machine's speeds): what can run here
(:mod:`.availability`) -> the bytes one step keeps alive, traced on the meta device (:mod:`.memory`, traces kept by
:mod:`.tracestore`) -> per-profile GPU and CPU peaks and the fastest that fits (:mod:`.planner`, priced by
:mod:`.steptime`) -> a frozen :class:`.resolve.RunSpec` for the loop. Around it: what would make a run fit
(:mod:`.advice`), the table (:mod:`.report`), the GPU catalogue (:mod:`.gpus`) and which card to rent
(:mod:`.compare`), and what to change after an OOM (:mod:`.ladder`)."""
