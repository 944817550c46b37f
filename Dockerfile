# vramfit with DeepSpeed on a CUDA devel base (nvcc is there for DeepSpeed's JIT ops).
#   docker build -t vramfit .
#   docker run --gpus all --ulimit memlock=-1 --shm-size=8g -v $PWD/runs:/app/runs vramfit configs/demo.yaml
# `--ulimit memlock=-1` lets offload profiles pin host memory; without it pin_memory is turned off.
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

# The same torch pin as scripts/setup.sh (the CUDA build on this base).
RUN pip install torch==2.13.0

WORKDIR /app
COPY pyproject.toml README.md ./
COPY launcher ./launcher

# DeepSpeed's CPU Adam op is compiled here, at image build time, not at the first offload run.
# The project and its extras come from pyproject.toml; DeepSpeed is built against the torch above.
RUN DS_BUILD_CPU_ADAM=1 pip install --no-build-isolation "deepspeed>=0.15" \
    && pip install ".[deepspeed,quant]" \
    && python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"

COPY ds_configs ./ds_configs
COPY configs ./configs
COPY scripts ./scripts

ENTRYPOINT ["deepspeed", "launcher/run.py"]
