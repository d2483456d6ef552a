import re

import pytest
from pydantic import ValidationError

from schemas import (
    BatchOutputLine,
    ChatRequest,
    ErrorInfo,
    ResultRecord,
    describe_validation_error,
    keys,
)
from tests.conftest import chat


def error_of(body: dict) -> str:
    with pytest.raises(ValidationError) as e:
        ChatRequest.model_validate(body)
    return describe_validation_error(e.value)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"model": "m", "messages": []}, "messages: List should have at least 1 item"),
        (chat("m") | {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (chat("m", max_tokens=-1), "max_tokens: Input should be greater than or equal to 1"),
        (chat("m", temperature=2.5), "temperature: Input should be less than or equal to 2"),
        (chat("m", top_p=0), "top_p"),
        (chat("m", n=200), "n: Input should be less than or equal to 128"),
        (chat("m", tools=[{"type": "function"}]), "tools.0.function: Field required"),
        (
            chat("m", stream=True, stream_options={"include_usage": True, "x": 1}),
            "unknown field 'x' in stream_options",
        ),
        (chat("m", top_logprobs=2), "top_logprobs needs logprobs: true"),
        (chat("m", frobnicate=1), "unknown field 'frobnicate'"),
        (chat("m", stop=["a", "b", "c", "d", "e"]), "at most 4 stop sequences"),
        (chat("m", stop=""), "stop sequences must not be empty"),
        (chat("m", max_tokens=5, max_completion_tokens=6), "differ"),
        (chat("m", num_draft_tokens=4), "no draft_model is named"),
        (chat("m", extra_params={"draft_model": "d", "x": 1}), "extra_params: unknown keys ['x']"),
        (chat("m", draft_model="a", extra_params={"draft_model": "b"}), "both at top level"),
        (chat("m", logit_bias={"1": 500}), "logit_bias values must be between"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model: Field required"),
    ],
)
def test_bad_requests_name_the_problem(body, expected):
    assert expected in error_of(body)


def test_valid_request_normalises_fields():
    req = ChatRequest.model_validate(
        chat(
            "m",
            stop="END",
            extra_params={"draft_model": "d"},
            logit_bias={"5": 2},
            stream=False,
            tools=[],
            response_format={"type": "text"},
        )
        | {
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        }
    )
    assert req.stop == ["END"]
    assert req.draft_model == "d"
    assert req.logit_bias == {5: 2.0}
    assert req.messages[0].as_template_dict() == {"role": "system", "content": "ab"}
    assert ChatRequest.model_validate(chat("m", max_completion_tokens=7)).token_limit == 7


def test_job_ids_are_deterministic_and_rq_safe():
    a = keys.job_id_for("b1", "row/1 with spaces")
    assert a == keys.job_id_for("b1", "row/1 with spaces")
    assert a != keys.job_id_for("b1", "row/2") != keys.job_id_for("b2", "row/1 with spaces")
    assert keys.batch_of(a) == "b1"
    import rq.job

    validate = getattr(rq.job, "validate_job_id", None)  # RQ >= 2.4 checks ids itself
    if validate is not None:
        validate(a)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", a)  # what RQ accepts in a job id
    with pytest.raises(ValueError, match="invalid batch id"):
        keys.validate_batch_id("bad id!")


def test_failed_record_becomes_batch_line_with_error():
    record = ResultRecord(
        job_id="b-1",
        batch_id="b",
        custom_id="c1",
        status="failed",
        status_code=404,
        error=ErrorInfo(message="no such model", code="model_not_found"),
        finished_at=1.0,
    )
    line = BatchOutputLine.from_record(record)
    assert line.custom_id == "c1"
    assert line.error.code == "model_not_found"
    assert line.response.status_code == 404
    assert line.response.body["error"]["message"] == "no such model"
