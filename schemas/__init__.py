"""mlxq's contract: request, job, result and batch-line models, errors and Redis keys.

Shared by producers, workers and other apps. Imports nothing else of mlxq and
never imports mlx.
"""

from schemas.errors import (
    ContextLengthError,
    GenerationError,
    IncompatibleDraftError,
    InvalidRequestError,
    JobTimeoutError,
    MlxqError,
    ModelLoadError,
    ModelNotAllowedError,
    ModelNotFoundError,
    ModelTooLargeError,
)
from schemas.job import JobEnvelope
from schemas.request import ChatRequest, Message, TextPart
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
    "AssistantMessage",
    "BatchInputLine",
    "BatchOutputLine",
    "ChatCompletion",
    "ChatRequest",
    "Choice",
    "ContextLengthError",
    "ErrorInfo",
    "GenerationError",
    "IncompatibleDraftError",
    "InvalidRequestError",
    "JobEnvelope",
    "JobTimeoutError",
    "Message",
    "Metrics",
    "MlxqError",
    "ModelLoadError",
    "ModelNotAllowedError",
    "ModelNotFoundError",
    "ModelTooLargeError",
    "ResultRecord",
    "TextPart",
    "Usage",
    "describe_validation_error",
]
