"""The GPU catalogue: cards people rent, with the numbers of their vendors' data sheets, so that the planner can
plan for a GPU that is not in this machine (``vramfit plan --gpu T4``, ``--compare-gpus``).

Every entry cites the data sheet (or architecture whitepaper) its numbers come from. Rules:

- Tensor-core TFLOPS are **dense**. Data sheets from Ampere on print the 2:4 structured-sparsity number with an
  asterisk; dense is half of it. For GeForce cards the whitepapers print two dense FP16 rates; the one used is
  "with FP32 accumulate", which is what torch's half-precision matmuls run (cuBLAS accumulates in fp32), half the
  "FP16 accumulate" rate on those cards. Data-center and workstation cards run both at the same rate.
- FP32 is the non-tensor (CUDA core) rate: torch does not use TF32 for matmuls unless asked.
- ``memory_bytes`` is the total memory the card reports to torch (``torch.cuda.mem_get_info``, the "total
  capacity" of its out-of-memory message), which is less than the data sheet's capacity: ECC on GDDR cards takes
  1/16 of it, the driver reserves some, and the amount moves a little between driver versions. Each value cites a
  public report (``memory_source``; where none names that exact card, ``unconfirmed`` says so). What a run can use
  is less again (the CUDA context, the allocator's slack), which the planner counts as lines of its own. The data
  sheet's capacity is kept in ``memory_gb``.
- Nothing here is fitted to measurements: no efficiency factors. Step times planned from these numbers are
  what the data sheet allows, i.e. optimistic.
- A number the cited source does not state is listed in the entry's ``unconfirmed`` with the reason.

:func:`machine` turns an entry into the step-time model's :class:`launcher.machine.speeds.Machine` (device rates from
the data sheet, host rates from this machine's calibration); :func:`hardware` into the planner's
:class:`launcher.machine.hardware.Hardware` record.
"""

from __future__ import annotations

import copy
import difflib
import re
from dataclasses import dataclass

from launcher.config.schema import ConfigError
from launcher.machine.hardware import GPUInfo, Hardware
from launcher.machine.speeds import Machine, Rates
from launcher.precision import supports_bf16, supports_fp16
from launcher.units import GiB

# PCIe: transfer rate per lane (GT/s) by generation, and the line code (3.0 and later: 128b/130b). One direction of
# an x16 link: 3.0 ~ 15.75 GB/s, 4.0 ~ 31.5 GB/s, 5.0 ~ 63 GB/s (PCI-SIG specifications; data sheets print the
# two directions added, e.g. "PCIe Gen4 64 GB/s").
PCIE_GT_PER_S = {3: 8.0, 4: 16.0, 5: 32.0}
PCIE_ENCODING = 128 / 130

# A fused AdamW step reads param, grad, m and v and writes param, m and v: 7 fp32 values = 28 bytes per parameter.
ADAMW_BYTES_PER_PARAM = 28
GPU_OPTIMIZERS = ("torch_fused_adamw", "deepspeed_fused_adam")

# The host cost of one CUDA kernel launch, used for each op's fixed cost when no calibration of this machine is
# given. NVIDIA, "Getting Started with CUDA Graphs" (https://developer.nvidia.com/blog/cuda-graphs/): a 2.9 us
# kernel launched back to back on one stream takes about 3.8 us per launch (9.6 us with a synchronisation after
# each). Those figures are as recalled from the article and could not be re-read here: treat them as unconfirmed.
# It is the launch alone; PyTorch's dispatch and autograd cost more per op, which is why the calibration of this
# machine is preferred. A view launches no kernel, so it costs nothing on this path.
CUDA_LAUNCH_S = 3.8e-6
CUDA_LAUNCH_SOURCE = "a CUDA kernel launch (NVIDIA, Getting Started with CUDA Graphs, developer.nvidia.com/blog/cuda-graphs/)"


@dataclass(frozen=True)
class GPUSpec:
    """One card of the catalogue, as its data sheet states it."""

    name: str  # the catalogue name, what --gpu takes: 'T4', 'A100-80GB-SXM'
    title: str  # 'NVIDIA T4'
    aliases: tuple[str, ...]  # other spellings (matched case-insensitively, ignoring spaces, '-' and '_')
    memory_gb: float  # the data sheet's capacity (GB of DRAM, i.e. binary: the T4's 16 GB are 16 GiB of chips)
    memory_bytes: int  # total memory the card reports to torch (see the module docstring)
    memory_source: str  # where memory_bytes comes from
    capability: tuple[int, int]  # CUDA compute capability (developer.nvidia.com/cuda-gpus)
    fp16_tflops: float  # dense FP16 tensor-core peak, FP32 accumulate
    bf16_tflops: float | None  # dense BF16 tensor-core peak; None where the card has no native bf16
    fp32_tflops: float  # non-tensor FP32 peak
    sparse_fp16_tflops: float | None  # the data sheet's "with sparsity" FP16 number (None: the sheet has none)
    bandwidth_gb_s: float  # memory bandwidth, GB/s (10^9 bytes)
    pcie_gen: int
    pcie_lanes: int
    source: str  # the data sheet: title and URL
    unconfirmed: tuple[str, ...] = ()  # numbers the source does not state, and why they are what they are
    nvlink_gb_s: float | None = None  # NVLink GPU-to-GPU bandwidth, both directions added, where the board has it

    @property
    def bf16(self) -> bool:
        return supports_bf16(self.capability)

    @property
    def fp16(self) -> bool:
        return supports_fp16(self.capability)

    @property
    def pcie_bytes_per_s(self) -> float:
        """Theoretical one-direction bandwidth of the host link."""
        return PCIE_GT_PER_S[self.pcie_gen] * 1e9 * PCIE_ENCODING * self.pcie_lanes / 8

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gb_s * 1e9


def _gib(x: float) -> int:
    return int(round(x * GiB))


# Data sheets and whitepapers cited below.
T4_SHEET = ("NVIDIA T4 Tensor Core GPU data sheet, "
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf")
L4_SHEET = ("NVIDIA L4 Tensor Core GPU data sheet, "
            "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet")
A10G_SOURCE = ("Amazon EC2 G5 instances (NVIDIA A10G, AWS's own variant, for which NVIDIA publishes no specification), "
               "https://aws.amazon.com/ec2/instance-types/g5/, and Baseten, NVIDIA A10 vs A10G for ML model "
               "inference, https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/")
GA102_PAPER = ("NVIDIA Ampere GA102 GPU Architecture whitepaper (Appendix A, GeForce RTX 3090), "
               "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf")
ADA_PAPER = ("NVIDIA Ada GPU Architecture whitepaper (GeForce RTX 4090), "
             "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf")
A4000_SHEET = ("NVIDIA RTX A4000 data sheet, "
               "https://www.nvidia.com/content/dam/en-zz/Solutions/gtcs21/rtx-a4000/nvidia-rtx-a4000-datasheet.pdf")
QRTX4000_SHEET = ("NVIDIA Quadro RTX 4000 data sheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
                  "design-visualization/quadro-product-literature/quadro-rtx-4000-datasheet.pdf")
A100_SHEET = ("NVIDIA A100 Tensor Core GPU data sheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
              "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
H100_SHEET = ("NVIDIA H100 Tensor Core GPU data sheet (H100 SXM and H100 PCIe columns), "
              "https://resources.nvidia.com/en-us-gpu-resources/h100-datasheet-24306")
H200_SHEET = ("NVIDIA H200 Tensor Core GPU data sheet (H200 SXM column), "
              "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446")


CATALOGUE: tuple[GPUSpec, ...] = (
    # Turing, 2018. "Mixed Precision (FP16/FP32) 65 TFLOPS" (Turing has no sparsity), "Single-Precision 8.1 TFLOPS",
    # "16 GB GDDR6, 300 GB/sec", "x16 PCIe Gen3". (256-bit at 10 Gbps would be 320 GB/s; the sheet says 300.)
    GPUSpec("T4", "NVIDIA T4", ("tesla-t4", "nvidia-t4"), 16, _gib(14.75),
            "14.75 GiB: PyTorch's OOM message on a Colab T4, github.com/hpcaitech/Open-Sora/issues/697 "
            "(nvidia-smi shows 15360 MiB: ECC takes 1 GiB of the 16)",
            (7, 5), 65.0, None, 8.1, None, 300, 3, 16, T4_SHEET),
    # Turing workstation card, 8 GB; rented on some VPS and notebook hosts. "Tensor Performance 57.0 TFLOPS"
    # (FP16; 288 tensor cores at the 1545 MHz boost clock give the same), "Single-Precision 7.1 TFLOPS",
    # "8 GB GDDR6", "416 GB/s", "PCI Express 3.0 x16".
    GPUSpec("QuadroRTX4000", "NVIDIA Quadro RTX 4000", ("quadro-rtx-4000", "rtx4000-quadro"), 8, _gib(8.0),
            "8 GiB, the data sheet's capacity: no report on Linux was found; the one found "
            "(github.com/minivision-ai/photo2cartoon/issues/61, Windows) shows 8.00 GiB total",
            (7, 5), 57.0, None, 7.1, None, 416, 3, 16, QRTX4000_SHEET,
            unconfirmed=("memory_bytes: the data sheet's 8 GiB; on Linux the card likely reports a little less",
                         "fp16_tflops: the sheet prints one 'Tensor Performance' number without naming the precision "
                         "or accumulation; Turing workstation cards run FP16 with FP32 accumulate at the full rate")),
    # Ada, 2023. FP16 and BF16 Tensor Core "242 teraFLOPS*" (*with sparsity), "FP32 30.3 teraFLOPs", "24GB",
    # "300GB/s", "PCIe Gen4 x16 64GB/s".
    GPUSpec("L4", "NVIDIA L4", ("nvidia-l4",), 24, _gib(22.05),
            "22.05 GiB: PyTorch's OOM message on the L4 of vLLM's CI, github.com/vllm-project/vllm/issues/20214",
            (8, 9), 121.0, 121.0, 30.3, 242.0, 300, 4, 16, L4_SHEET),
    # Ampere GA102, AWS's variant of the A10: no NVIDIA data sheet. AWS states 24 GB per GPU and 320 tensor cores
    # (80 SMs); Baseten's comparison states 24 GB GDDR6 at 600 GB/s and that the A10G has less tensor and more
    # CUDA-core throughput than the A10 (125 / 31.2 TFLOPS). 35.0 TFLOPS FP32 = 80 SMs x 128 FMA x 2 at the 1710 MHz
    # boost clock; 70 TFLOPS FP16/BF16 = half of that tensor rate at the A10's per-SM rate, as on GeForce GA102. A
    # cuBLAS measurement reaching 69.5 TFLOPS in FP16 and BF16 on an A10G
    # (github.com/zzc0721/torch-performance-test-data/issues/126) agrees with 70 and rules out 125.
    GPUSpec("A10G", "NVIDIA A10G", ("nvidia-a10g",), 24, _gib(22.49),
            "22.49 GiB: PyTorch's OOM message on an A10G, github.com/AUTOMATIC1111/stable-diffusion-webui/issues/1259",
            (8, 6), 70.0, 70.0, 35.0, None, 600, 4, 16, A10G_SOURCE,
            unconfirmed=("fp16_tflops, bf16_tflops, fp32_tflops: stated by no NVIDIA or AWS document; derived from "
                         "the SM count and boost clock (third-party listings) and checked against a measurement",
                         "bandwidth_gb_s: 600 GB/s from Baseten's comparison (third party)",
                         "pcie: Gen4 x16 as for every GA102 card; not stated by AWS")),
    # Ampere GA102, 2020. "Peak FP16 Tensor TFLOPS with FP32 Accumulate 71/142" (dense/sparse; 142/284 with FP16
    # accumulate), "Peak BF16 Tensor TFLOPS with FP32 Accumulate 71/142", "Peak FP32 TFLOPS (non-Tensor) 35.6",
    # 24 GB GDDR6X, "936 GB/sec", PCIe Gen 4.
    GPUSpec("RTX3090", "NVIDIA GeForce RTX 3090", ("3090", "rtx-3090", "geforce-rtx-3090"), 24, _gib(23.69),
            "23.69 GiB: PyTorch's OOM message on an RTX 3090, github.com/ucwxb/GraphAvatar/issues/4 (no ECC)",
            (8, 6), 71.0, 71.0, 35.6, 142.0, 936, 4, 16, GA102_PAPER),
    # Ada AD102, 2022. "Peak FP16 Tensor TFLOPS with FP32 Accumulate 165.2/330.4" (330.3/660.6 with FP16
    # accumulate), "Peak BF16 Tensor TFLOPS with FP32 Accumulate 165.2/330.4", "Peak FP32 TFLOPS (non-Tensor) 82.6",
    # 24 GB GDDR6X, "1008 GB/sec", PCIe Gen 4.
    GPUSpec("RTX4090", "NVIDIA GeForce RTX 4090", ("4090", "rtx-4090", "geforce-rtx-4090"), 24, _gib(23.64),
            "23.64 GiB: PyTorch's OOM message on an RTX 4090, github.com/ali-vilab/VGen/issues/104 (no ECC)",
            (8, 9), 165.2, 165.2, 82.6, 330.4, 1008, 4, 16, ADA_PAPER),
    # Ampere GA104 workstation card, 16 GB; common on VPS hosts. "Tensor performance 153.4 TFLOPS" (with sparsity:
    # 192 tensor cores at the 1560 MHz boost give 76.7 dense), "Single-precision performance 19.2 TFLOPS",
    # "16 GB GDDR6 with ECC", "448 GB/s", "PCI Express 4.0 x16".
    GPUSpec("RTXA4000", "NVIDIA RTX A4000", ("rtx-a4000", "a4000"), 16, _gib(15.61),
            "15.61 GiB: PyTorch's OOM message on an RTX A4000, github.com/DengKaiCQ/VGGT-Long/issues/6 "
            "(15.73 GiB with an older driver, github.com/Zeqiang-Lai/Mini-DALLE3/issues/9)",
            (8, 6), 76.7, 76.7, 19.2, 153.4, 448, 4, 16, A4000_SHEET,
            unconfirmed=("fp16_tflops, bf16_tflops: the sheet prints one tensor number (sparse) without naming the "
                         "precision; Ampere tensor cores run FP16 and BF16 at the same rate (GA102 whitepaper)",)),
    # Ampere GA100, 2020. "FP16 Tensor Core 312 TFLOPS | 624 TFLOPS*", "BFLOAT16 Tensor Core 312 | 624*",
    # "FP32 19.5 TFLOPS"; 40GB HBM2 "1,555GB/s" (PCIe and SXM), 80GB HBM2e "1,935GB/s" (PCIe) and "2,039GB/s" (SXM);
    # "PCIe Gen4: 64GB/s" (both directions). The SXM module reaches the host over PCIe Gen4 x16 as well.
    GPUSpec("A100-40GB-SXM", "NVIDIA A100 40GB SXM4",
            ("a100-40gb", "a100-sxm4-40gb", "a100-sxm-40gb", "a100-40gb-sxm4"), 40, _gib(39.50),
            "39.50 GiB: PyTorch's OOM message on an A100 40GB, github.com/TianheWu/CoSeR/issues/10 (form factor not "
            "named; 39.38-39.56 GiB appear in other reports)",
            (8, 0), 312.0, 312.0, 19.5, 624.0, 1555, 4, 16, A100_SHEET, nvlink_gb_s=600),
    GPUSpec("A100-40GB-PCIe", "NVIDIA A100 40GB PCIe",
            ("a100-pcie-40gb", "a100-40gb-pcie", "a100-pcie"), 40, _gib(39.50),
            "39.50 GiB: as the SXM4 40GB (github.com/TianheWu/CoSeR/issues/10, form factor not named)",
            (8, 0), 312.0, 312.0, 19.5, 624.0, 1555, 4, 16, A100_SHEET,
            unconfirmed=("memory_bytes: no report naming the PCIe 40GB card was found; the 40GB figure is used",)),
    GPUSpec("A100-80GB-SXM", "NVIDIA A100 80GB SXM4",
            ("a100-80gb", "a100-sxm4-80gb", "a100-sxm-80gb", "a100-80gb-sxm4"), 80, _gib(79.15),
            "79.15 GiB: PyTorch's OOM message on an A100 80GB, github.com/vllm-project/vllm/issues/4408 (form factor "
            "not named)",
            (8, 0), 312.0, 312.0, 19.5, 624.0, 2039, 4, 16, A100_SHEET, nvlink_gb_s=600),
    GPUSpec("A100-80GB-PCIe", "NVIDIA A100 80GB PCIe", ("a100-pcie-80gb", "a100-80gb-pcie"), 80, _gib(79.15),
            "79.15 GiB: as the SXM4 80GB (github.com/vllm-project/vllm/issues/4408, form factor not named)",
            (8, 0), 312.0, 312.0, 19.5, 624.0, 1935, 4, 16, A100_SHEET,
            unconfirmed=("memory_bytes: no report naming the PCIe 80GB card was found; the 80GB figure is used",)),
    # Hopper GH100, 2022. H100 SXM: "FP16 Tensor Core 1,979 teraFLOPS*", "BFLOAT16 Tensor Core 1,979*", "FP32 67",
    # "80GB", "3.35TB/s"; H100 PCIe: "1,513*", "1,513*", "FP32 51", "80GB", "2TB/s"; both "PCIe Gen5: 128GB/s"
    # (both directions). *With sparsity; specifications are one-half lower without it.
    GPUSpec("H100-SXM", "NVIDIA H100 SXM5", ("h100-sxm5", "h100-80gb-hbm3", "h100-sxm-80gb"), 80, _gib(79.11),
            "79.11 GiB: PyTorch's OOM message on an H100, github.com/vllm-project/vllm/issues/27508 (form factor "
            "not named)",
            (9, 0), 989.5, 989.5, 67.0, 1979.0, 3350, 5, 16, H100_SHEET, nvlink_gb_s=900),
    GPUSpec("H100-PCIe", "NVIDIA H100 PCIe", ("h100-pcie-80gb",), 80, _gib(79.11),
            "79.11 GiB: as the SXM5 (github.com/vllm-project/vllm/issues/27508, form factor not named)",
            (9, 0), 756.5, 756.5, 51.0, 1513.0, 2000, 5, 16, H100_SHEET,
            unconfirmed=("memory_bytes: no report naming the PCIe card was found; the H100 80GB figure is used",)),
    # Hopper GH100 with HBM3e, 2024. H200 SXM: "BFLOAT16 Tensor Core 1,979 TFLOPS*", "FP16 Tensor Core 1,979*",
    # "FP32 67 TFLOPS", "141GB", "4.8TB/s", "PCIe Gen5: 128GB/s". (The H200 NVL is a different, slower card.)
    GPUSpec("H200-SXM", "NVIDIA H200 SXM", ("h200", "h200-141gb", "nvidia-h200"), 141, _gib(139.80),
            "139.80 GiB: the total capacity PyTorch's OOM messages print on H200s in several public training logs",
            (9, 0), 989.5, 989.5, 67.0, 1979.0, 4800, 5, 16, H200_SHEET,
            unconfirmed=("memory_bytes: seen in several public logs, no single issue to cite",), nvlink_gb_s=900),
)

# Links between the cards of one machine and between machines (``vramfit plan --gpus N [--nodes M]``).
# SXM boards (A100, H100, H200) connect their GPUs over NVLink through NVSwitch: the data sheets print "NVLink:
# 600GB/s" (A100) and "900GB/s" (H100, H200), both directions added; a ring collective sends in one direction, half
# of it. PCIe cards (and GeForce cards, whose NVLink bridges rented boxes do not fit) reach each other over PCIe:
# at best the host link's one-direction bandwidth, through the CPU's root complex or a PCIe switch. Between machines:
# a network of ``--network-gbps`` gigabits per second, by default 10, the "up to 10 Gigabit" that cloud GPU instances
# of one or a few cards list (e.g. Amazon EC2 G5 below 8 GPUs, https://aws.amazon.com/ec2/instance-types/g5/).
DEFAULT_NETWORK_GBPS = 10.0


def links(spec: GPUSpec, network_gbps: float = DEFAULT_NETWORK_GBPS) -> dict:
    """Bytes/s one rank sends to the next in a ring: ``intra`` (same machine), ``inter`` (between machines)."""
    if network_gbps is None or not network_gbps > 0:
        raise ConfigError([f"--network-gbps: got {network_gbps!r}; rule: a positive number of gigabits per second; "
                           f"fix: --network-gbps {DEFAULT_NETWORK_GBPS:g}"], "command line")
    if spec.nvlink_gb_s:
        intra, src = spec.nvlink_gb_s / 2 * 1e9, f"NVLink ({spec.nvlink_gb_s:g} GB/s both directions, the data sheet)"
    else:
        intra, src = spec.pcie_bytes_per_s, f"PCIe {spec.pcie_gen}.0 x{spec.pcie_lanes} between the cards"
    return {"intra": intra, "inter": network_gbps * 1e9 / 8, "intra_source": src,
            "inter_source": f"a {network_gbps:g} Gbit/s network between machines"}


# Names that mean several cards: asking for them is an error that lists the choices.
AMBIGUOUS = {"a100": ("A100-40GB-SXM", "A100-40GB-PCIe", "A100-80GB-SXM", "A100-80GB-PCIe"),
             "h100": ("H100-SXM", "H100-PCIe")}

# Words torch's device names carry that the user may or may not type.
_VENDOR_WORDS = {"nvidia", "geforce", "tesla"}


def _norm(name: str) -> str:
    """'NVIDIA GeForce RTX 3090' -> 'rtx3090'; 'tesla-t4' -> 't4'; 'A100 40GB' -> 'a10040gb'."""
    words = [w for w in re.split(r"[^0-9a-z]+", name.lower()) if w and w not in _VENDOR_WORDS]
    return "".join(words)


def _index() -> dict[str, GPUSpec]:
    out: dict[str, GPUSpec] = {}
    for spec in CATALOGUE:
        for alias in (spec.name, spec.title, *spec.aliases):
            key = _norm(alias)
            if key in out and out[key] is not spec:
                raise RuntimeError(f"GPU catalogue: {alias!r} names both {out[key].name} and {spec.name}")
            out[key] = spec
    return out


_INDEX = _index()


def names() -> list[str]:
    """The catalogue's names, as ``--gpu`` takes them."""
    return [spec.name for spec in CATALOGUE]


def find(name: str, flag: str = "--gpu", value: str | None = None) -> GPUSpec:
    """The catalogue entry for ``name`` (case, spaces, '-' and '_' ignored; 'NVIDIA', 'GeForce' and 'Tesla'
    optional). Raises :class:`ConfigError` for an unknown or ambiguous name, naming the option it came from
    (``flag``: ``--gpu``, or ``--price`` with the ``value`` it priced the card at)."""
    key = _norm(name)
    if key in _INDEX:
        return _INDEX[key]

    def fix(card: str) -> str:
        return f"{flag} {card}" + (f"={value}" if value is not None else "")

    if key in AMBIGUOUS:
        choices = AMBIGUOUS[key]
        raise ConfigError([f"{flag}: got {name!r}, which names {len(choices)} cards; rule: the card must be exact "
                           f"(memory and speed differ); fix: one of {', '.join(fix(c) for c in choices)}"],
                          "command line")
    close = difflib.get_close_matches(key, list(_INDEX), n=1, cutoff=0.6)
    hint = f" (did you mean {_INDEX[close[0]].name}?)" if close else ""
    tail = ", or plan for this machine without --gpu" if flag == "--gpu" else ""
    raise ConfigError([f"{flag}: got {name!r}{hint}; rule: a GPU of the catalogue ({', '.join(names())}); "
                       f"fix: {fix(_INDEX[close[0]].name if close else names()[0])}{tail} (docs/gpus.md says how "
                       "to add a card)"], "command line")


# ------------------------------------------------------------------------------------------------
# The step-time model's view of the card


def _calibrated(host: Machine) -> bool:
    """Whether ``host`` is a calibration of this machine (it measured the fixed cost of an op)."""
    return host.compute.op_s > 0


def machine(spec: GPUSpec, host: Machine) -> Machine:
    """The :class:`Machine` of a rented ``spec`` whose host is like this one.

    Device rates: the data sheet's dense peaks, flat at every matmul size (no falloff for small matmuls is known
    from a data sheet, so small ones come out optimistic), the same peaks for fused attention, and the data
    sheet's bandwidth for everything memory-bound. The fixed cost of an op is the framework's on the host CPU, so
    it comes from this machine's calibration (``host.compute``) when ``host`` is one, otherwise from the cost of
    a CUDA kernel launch. Host rates (the CPU, optimizers that run on it, the engines' fixed and per-tensor costs,
    the disk): this machine's calibration stands in for the rented host's CPU; the engines' per-parameter costs
    measured here are left out (:func:`engine_costs_on_paper`). Copies between host and GPU: the PCIe link's
    theoretical one-direction bandwidth.
    """
    peaks = {"float16": spec.fp16_tflops * 1e12, "float32": spec.fp32_tflops * 1e12}
    if spec.bf16 and spec.bf16_tflops:
        peaks["bfloat16"] = spec.bf16_tflops * 1e12
    bandwidth = spec.bandwidth_bytes_per_s
    if _calibrated(host):
        op_s, view_s = host.compute.op_s, host.compute.view_s
        op_source = f"per-op fixed costs from the calibration of {host.name}"
    else:
        op_s, view_s = CUDA_LAUNCH_S, 0.0
        op_source = f"per-op fixed cost {CUDA_LAUNCH_S * 1e6:.1f} us, {CUDA_LAUNCH_SOURCE}"
    compute = Rates(device="cuda", matmul={k: [[1.0, v]] for k, v in peaks.items()}, attention=dict(peaks),
                    memory_bytes_per_s=bandwidth, op_s=op_s, view_s=view_s)
    pcie = spec.pcie_bytes_per_s
    # A pageable copy is staged by the driver through a pinned buffer: the CPU first copies the bytes into it (a
    # read and a write of host memory per byte, and host memory_bytes_per_s counts bytes read + written), then the
    # DMA engine moves them over the link. Whichever is slower bounds it.
    pageable = min(pcie, host.host.memory_bytes_per_s / 2)
    link = {"pinned": pcie, "pageable": pageable}
    # The host's CPU optimizers stay (offload profiles step on the CPU); the GPU's are priced from its bandwidth.
    optimizers = {k: list(v) for k, v in host.optimizers.items() if k.endswith("@cpu")}
    for kind in GPU_OPTIMIZERS:
        # The per-tensor cost is the host's: launching the fused kernels over each chunk of tensors.
        per_tensor = (host.optimizers.get(f"{kind}@cuda") or host.optimizers.get(f"{kind}@cpu")
                      or host.optimizers.get("torch_fused_adamw@cpu") or (0.0, 0.0))[1]
        optimizers[f"{kind}@cuda"] = [ADAMW_BYTES_PER_PARAM / bandwidth, per_tensor]
    engines, dropped = engine_costs_on_paper(host.engines)
    source = (f"{spec.source}: dense tensor-core and FP32 peaks, {spec.bandwidth_gb_s:g} GB/s, PCIe "
              f"{spec.pcie_gen}.0 x{spec.pcie_lanes}; {op_source}; host CPU, CPU optimizers and the engines' fixed "
              f"and per-tensor costs from {host.name} ({host.source}), standing in for the rented host's CPU; the "
              "engines' per-parameter costs measured there are left out (on the card they are the copies and "
              "passes priced from the data sheet)")
    return Machine(name=f"{spec.title} (data sheet: step times on paper)", source=source, compute=compute,
                   host=host.host, h2d_bytes_per_s=dict(link), d2h_bytes_per_s=dict(link), optimizers=optimizers,
                   engines=engines, disk_write_bytes_per_s=host.disk_write_bytes_per_s,
                   threads=host.threads, measured={"gpu": spec.name, "host": host.name,
                                                   # the host's share of each step is priced with its speeds
                                                   **{k: f"the host's calibration: {host.measured[k]}"
                                                      for k in ("doubtful", "busy_now") if host.measured.get(k)},
                                                   "unconfirmed": list(spec.unconfirmed),
                                                   "on_paper": ["every device rate (data sheet peaks)",
                                                                "host-device copies (PCIe theoretical)"]
                                                   + [f"{k} per parameter: left out" for k in dropped]})


# An engine's cost per parameter, as ``vramfit doctor --calibrate`` measures it, is a pass over the weights or
# gradients in the memory the engine computes in: with DeepSpeed's CPU accelerator (or FSDP on a CPU mesh) that is
# host memory, e.g. ZeRO-3 gathering a parameter is a host-memory copy at this CPU's speed (~2.5-5 ns per parameter
# on a 2-core box, 20-40 s per micro-batch of a 7B model). On a GPU the same work is the PCIe copy of the 16-bit
# weights and the device-memory passes that the step-time model prices already from the card's data sheet
# (``grad_copies``/``weight_copies``/``memory_traffic`` of :func:`launcher.plan.steptime.predict`), so a measured
# per-parameter term would count it twice at the wrong speed. The fixed and per-tensor terms (Python bookkeeping,
# hooks, bucketing) run on the host CPU in either case and stay, with this machine's CPU standing in.
PER_PARAMETER_TERMS = ("micro_param_s", "step_param_s")


def engine_costs_on_paper(engines: dict) -> tuple[dict, list[str]]:
    """``engines`` (a calibration's fixed costs per engine family) without the per-parameter terms, and the
    families that had one."""
    out, dropped = {}, []
    for fam, terms in engines.items():
        out[fam] = {k: (0.0 if k in PER_PARAMETER_TERMS else v) for k, v in terms.items()}
        if any(terms.get(k) for k in PER_PARAMETER_TERMS):
            dropped.append(fam)
    return out, dropped


# ------------------------------------------------------------------------------------------------
# The planner's view of the card


def hardware(spec: GPUSpec, host_hw: Hardware, ram_gib: float | None = None) -> Hardware:
    """This machine's :class:`Hardware` record with ``spec`` as its one GPU, free memory = total (a rented card
    runs nothing else), and ``ram_gib`` GiB of RAM, all available (default: this machine's RAM). The software
    (torch, DeepSpeed, ...) stays this machine's: the plan assumes the rented host installs the same."""
    if ram_gib is not None and not ram_gib > 0:
        raise ConfigError([f"RAM for {spec.name}: got {ram_gib!r} GiB; rule: a positive number of GiB; "
                           "fix: give the rented host's RAM, e.g. 32"], "command line")
    hw = copy.deepcopy(host_hw)
    cap = spec.capability
    hw.gpus = [GPUInfo(0, spec.title, spec.memory_bytes, spec.memory_bytes, cap,
                       fp16=supports_fp16(cap), bf16=supports_bf16(cap))]
    if ram_gib is not None:
        hw.ram_total_bytes = hw.ram_available_bytes = int(ram_gib * GiB)
    # the rented host's `ulimit -l`, not this machine's: GPU images are run with the limit lifted (docker's
    # --ulimit memlock=-1, as NVIDIA's containers ask), so the plan pins where the RAM allows
    hw.memlock_limit_bytes = None
    return hw


# ------------------------------------------------------------------------------------------------
# The table of docs/gpus.md (tests/test_gpus.py checks that the page carries it)


def _links(source: str) -> str:
    """'Title, URL[, and Title, URL]' -> Markdown links labelled by kind of document."""
    urls = re.findall(r"https?://[^\s,]+", source)
    titles = re.split(r"https?://[^\s,]+", source)[:len(urls)]
    out = []
    for title, url in zip(titles, urls):
        label = ("whitepaper" if "whitepaper" in title else "data sheet" if "data sheet" in title
                 else re.sub(r"^(www\.)?", "", url.split("/")[2]))
        out.append(f"[{label}]({url})")
    return ", ".join(out)


def markdown_table() -> str:
    """The catalogue as the Markdown table of docs/gpus.md."""
    rows = ["| `--gpu` | card | memory: data sheet / reported | capability | bf16 | dense FP16 / BF16 TFLOPS "
            "| FP32 TFLOPS | bandwidth GB/s | PCIe (one direction) | source |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in CATALOGUE:
        bf16 = f"{s.bf16_tflops:g}" if s.bf16_tflops else "-"
        mark = " *" if s.unconfirmed else ""
        rows.append(f"| `{s.name}` | {s.title}{mark} | {s.memory_gb:g} GB / {s.memory_bytes / GiB:.2f} GiB "
                    f"| {s.capability[0]}.{s.capability[1]} | {'yes' if s.bf16 else 'no'} | {s.fp16_tflops:g} / {bf16} "
                    f"| {s.fp32_tflops:g} | {s.bandwidth_gb_s:g} | {s.pcie_gen}.0 x{s.pcie_lanes} "
                    f"({s.pcie_bytes_per_s / 1e9:.2f} GB/s) | {_links(s.source)} |")
    notes = [f"- {s.title}: {note}" for s in CATALOGUE for note in s.unconfirmed]
    return "\n".join(rows + ["", "\\* Not stated by the cited source:", ""] + notes)
