"""mlxq's contract: request, job, result and batch-line models, errors and Redis keys.

Shared by producers, workers and other apps. Imports nothing else of mlxq and
never imports mlx.
"""

from schemas.errors import (
    CancelledError,
    ContextLengthError,
    ContextTooLargeError,
    GenerationError,
    IncompatibleDraftError,
    InvalidRequestError,
    JobTimeoutError,
    MlxqError,
    ModelKindError,
    ModelLoadError,
    ModelNotAllowedError,
    ModelNotFoundError,
    ModelTooLargeError,
    PoisonJobError,
    QuotaExceededError,
    UnsafeJobError,
)
from schemas.job import ENDED_JOB_DATA, JobEnvelope, JobRefused, StoredJob, job_data, read_job_hash
from schemas.request import ChatRequest, ImagePart, Message, TextPart
from schemas.result import (
    AssistantMessage,
    BatchInputLine,
    BatchOutputLine,
    ChatCompletion,
    Choice,
    ErrorInfo,
    Metrics,
    ResultRecord,
    Usage,
)
from schemas.validation import describe_validation_error

__all__ = [
    "ENDED_JOB_DATA",
    "AssistantMessage",
    "BatchInputLine",
    "BatchOutputLine",
    "CancelledError",
    "ChatCompletion",
    "ChatRequest",
    "Choice",
    "ContextLengthError",
    "ContextTooLargeError",
    "ErrorInfo",
    "GenerationError",
    "ImagePart",
    "IncompatibleDraftError",
    "InvalidRequestError",
    "JobEnvelope",
    "JobRefused",
    "JobTimeoutError",
    "Message",
    "Metrics",
    "MlxqError",
    "ModelKindError",
    "ModelLoadError",
    "ModelNotAllowedError",
    "ModelNotFoundError",
    "ModelTooLargeError",
    "PoisonJobError",
    "QuotaExceededError",
    "ResultRecord",
    "StoredJob",
    "TextPart",
    "UnsafeJobError",
    "Usage",
    "describe_validation_error",
    "job_data",
    "read_job_hash",
]
