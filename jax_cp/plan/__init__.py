"""Pod planner: compile a layout ahead of time for a TPU topology on any machine and report on it.

``analyze(topology="v5e:4x4", model="llama3-8b", seq_len=8192, cp_ulysses=4, tp=4)``
compiles forward+backward of one ``CPAttention`` layer (and the naive fused-QKV
baseline) with the real TPU compiler from the ``libtpu`` wheel and returns a
``Report``: per-device memory, every collective of the schedule with its mesh
axes and bytes, the overlap fraction forward and backward, FLOPs and an
estimated step time. ``strategy="auto"`` chooses the layout. Command line:
``python -m jax_cp.plan --help``. ``compare(topology=..., layouts=[(1, 4, 1), (4, 1, 4)], ...)``
plans several layouts alike; every report ends with a verdict line (which layout to run, and
why). ``recommended_xla_flags`` gives the flags that make collectives asynchronous,
``apply_recommended_flags`` sets them for the process, ``compiler_options`` turns them into
per-compile options.
A whole training step: ``python -m models.train --plan TOPOLOGY ...``
(``models.train.plan_train_step``), or ``analyze_program`` for your own.
"""
from jax_cp.plan._analyze import (
    STRATEGIES, analyze, analyze_program, compare, get_topology, kv_exchanges, parse_layout, set_topology,
    topology_mesh,
)
from jax_cp.plan._build import LayerShape, cp_layer, naive_layer
from jax_cp._chips import CHIPS, Chip, chip_for
from jax_cp.plan._flags import (
    FLAG_ENV, apply_for_this_host, apply_recommended_flags, compiler_options, recommended_xla_flags,
)
from jax_cp.plan._hlo import Collective, Schedule, Timeline, analyze_schedule, loop_bytes, timeline
from jax_cp.plan._hlo_text import parse_module
from jax_cp.plan._models import MODELS, ModelSpec
from jax_cp.plan._report import Analysis, Comparison, Estimate, Memory, Report, analysis_of, format_programs
from jax_cp.plan._verdict import Option, Verdict, verdict

__all__ = [
    "Analysis", "CHIPS", "Chip", "Collective", "Comparison", "Estimate", "FLAG_ENV", "LayerShape", "MODELS",
    "Memory", "ModelSpec", "Option", "Report", "STRATEGIES", "Schedule", "Timeline", "Verdict", "analyze", "analyze_program",
    "analysis_of", "analyze_schedule", "apply_for_this_host", "apply_recommended_flags", "chip_for", "compare", "compiler_options",
    "cp_layer", "format_programs", "get_topology", "kv_exchanges", "loop_bytes", "naive_layer", "parse_layout",
    "parse_module",
    "recommended_xla_flags", "set_topology", "timeline", "topology_mesh", "verdict",
]
