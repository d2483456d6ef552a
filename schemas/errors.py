"""The error hierarchy shared by producers and workers.

Every error carries an OpenAI-style ``code`` and ``type`` so that a failed job's
result record reads like an OpenAI API error.
"""

from __future__ import annotations


class MlxqError(Exception):
    """Root of all mlxq errors."""

    code = "server_error"
    type = "server_error"
    status_code = 500


class InvalidRequestError(MlxqError):
    """The request itself is wrong: bad fields, unsupported options, bad model names."""

    code = "invalid_request"
    type = "invalid_request_error"
    status_code = 400


class ModelNotAllowedError(InvalidRequestError):
    """The worker's allowlist does not include the requested model."""

    code = "model_not_allowed"
    status_code = 403


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit the model's context window."""

    code = "context_length_exceeded"


class ModelKindError(InvalidRequestError):
    """The job's kind does not fit the model's: chat on an embedding model, or the reverse."""

    code = "wrong_model_kind"


class IncompatibleDraftError(InvalidRequestError):
    """The draft model's tokenizer differs from the target's."""

    code = "incompatible_draft_model"


class ModelLoadError(MlxqError):
    """A model could not be loaded (missing, unreadable, unsupported)."""

    code = "model_load_error"


class ModelNotFoundError(ModelLoadError):
    """No local path or hub repository of that name."""

    code = "model_not_found"
    type = "invalid_request_error"
    status_code = 404


class ModelTooLargeError(ModelLoadError):
    """The model does not fit in the worker's memory budget."""

    code = "model_too_large"
    status_code = 507


class ContextTooLargeError(MlxqError):
    """The job's KV cache (prompt + max_tokens) does not fit the worker's memory, even alone."""

    code = "context_too_large"
    type = "invalid_request_error"
    status_code = 507


class GenerationError(MlxqError):
    """Generation failed after the model was loaded."""

    code = "generation_error"


class JobTimeoutError(MlxqError):
    """The job ran past its timeout."""

    code = "timeout"
    status_code = 504


class UnsafeJobError(InvalidRequestError):
    """The job hash is not one mlxq runs: another function, callbacks, webhooks, pickle."""

    code = "unsafe_job"


class PoisonJobError(MlxqError):
    """The job's worker died too many times while running it."""

    code = "poison_job"


class QuotaExceededError(MlxqError):
    """The job's tenant used its tokens of the day (``producer tenant set --tokens-per-day``)."""

    code = "quota_exceeded"
    type = "rate_limit_error"
    status_code = 429


class CancelledError(MlxqError):
    """The job was cancelled (``producer cancel``, the Batch API's cancel or expiry, a
    gateway client gone): before it started, or while it ran."""

    code = "cancelled"
    type = "cancelled"
    status_code = 499
