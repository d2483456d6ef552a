"""mlxq producer: submit chat jobs to Redis and read results back. Never imports mlx."""

from producer.batches import BatchStatus, batch_status, iter_output_lines, wait_for_batch
from producer.client import Client
from producer.lines import Defaults, parse_file, parse_lines
from producer.submit import SubmitItem, SubmitSummary, submit_items

__all__ = [
    "BatchStatus",
    "Client",
    "Defaults",
    "SubmitItem",
    "SubmitSummary",
    "batch_status",
    "iter_output_lines",
    "parse_file",
    "parse_lines",
    "submit_items",
    "wait_for_batch",
]
