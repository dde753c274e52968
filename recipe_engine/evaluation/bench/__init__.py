"""``recipe bench``: generation speed, latency and size of one or two checkpoints, as models are served."""
from .int4 import Int4Linear, check_packed, held_int4_bytes, load_packed, packed_config
from .memory import RequestMemory, check_memory, planned_weight_bytes, request_memory
from .protocol import MODES, PAPER, Shape, protocol_note, shapes
from .run import BenchPlan, bench, bytes_read_per_token, logical_parameters, ratios
from .timing import alternate, percentile, spread

__all__ = ["MODES", "PAPER", "BenchPlan", "Int4Linear", "RequestMemory", "Shape", "alternate", "bench",
           "bytes_read_per_token", "check_memory", "check_packed", "held_int4_bytes", "load_packed",
           "logical_parameters", "packed_config", "percentile", "planned_weight_bytes", "protocol_note", "ratios",
           "request_memory", "shapes", "spread"]
