"""``recipe bench``: generation speed, latency and size of one or two checkpoints, as models are served."""
from .int4 import Int4Linear, check_packed, load_packed, packed_config
from .protocol import MODES, PAPER, Shape, protocol_note, shapes
from .run import BenchPlan, bench, bytes_read_per_token, ratios
from .timing import alternate, percentile, spread

__all__ = ["MODES", "PAPER", "BenchPlan", "Int4Linear", "Shape", "alternate", "bench", "bytes_read_per_token", "check_packed",
           "load_packed", "packed_config", "percentile", "protocol_note", "ratios", "shapes", "spread"]
