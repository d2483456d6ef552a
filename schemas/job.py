"""The job envelope: what a producer puts on the queue (JSON) for a worker."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from schemas.keys import DEFAULT_RESULT_TTL
from schemas.request import ChatRequest


class JobEnvelope(BaseModel):
    """One chat job: ids, timing and the validated request. The RQ job's only argument."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(min_length=1)
    batch_id: str = Field(min_length=1)
    custom_id: str = Field(min_length=1)
    submitted_at: float
    result_ttl: int = Field(default=DEFAULT_RESULT_TTL, ge=1)
    request: ChatRequest
