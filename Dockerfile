# vramfit with DeepSpeed on a CUDA devel base (nvcc is there for DeepSpeed's JIT ops). The entry point is the
# vramfit command, so the image runs any of its commands (train, the default, runs the built-in demo):
#   docker build -t vramfit .
#   docker run --gpus all vramfit doctor
#   docker run --gpus all vramfit plan configs/demo.yaml
#   docker run --gpus all --ulimit memlock=-1 --shm-size=8g -v $PWD/runs:/app/runs vramfit train configs/demo.yaml
# Several GPUs go through DeepSpeed's launcher, which starts one process per GPU (launcher/run.py takes the
# same arguments as train):
#   docker run --gpus all --ulimit memlock=-1 --shm-size=8g -v $PWD/runs:/app/runs \
#     --entrypoint deepspeed vramfit launcher/run.py configs/demo.yaml
# `--ulimit memlock=-1` lets offload profiles pin host memory; without it pin_memory is turned off.
# Every package is installed at the version CI tested (requirements/lock.txt, a pip constraints file).
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    TORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;8.9;9.0" \
    DS_ACCELERATOR=cuda

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ninja-build libaio-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /app
COPY requirements/lock.txt ./requirements/lock.txt

# torch first, in its own layer: the lock's pin is the CUDA build on this base (the CPU build on the CI machine).
RUN pip install -c requirements/lock.txt torch

COPY pyproject.toml README.md ./
COPY launcher ./launcher

# DeepSpeed's CPU Adam op is compiled here, at image build time, not at the first offload run.
# The project and its extras come from pyproject.toml; DeepSpeed is built against the torch above.
RUN DS_BUILD_CPU_ADAM=1 pip install --no-build-isolation -c requirements/lock.txt deepspeed \
    && pip install -c requirements/lock.txt ".[deepspeed,quant,kernels]" \
    && python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"

COPY ds_configs ./ds_configs
COPY configs ./configs
COPY scripts ./scripts

ENTRYPOINT ["vramfit"]
CMD ["train"]
