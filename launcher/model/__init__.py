"""The model a run trains: ``model.name`` -> its transformers config (:mod:`.hfconfig`, :mod:`.presets`) -> the
built model (:mod:`.build`), its base optionally quantized (:mod:`.quantize`), adapted (:mod:`.lora` on the layers
:mod:`.targets` picks), with activation checkpointing (:mod:`.checkpointing`) or offload (:mod:`.actoffload`) and
faster kernels (:mod:`.kernels`); the loss every engine and the planner's trace call (:mod:`.loss`); and a finished
run -> a standalone model (:mod:`.export`)."""
