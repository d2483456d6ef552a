from schemas import AssistantMessage, ChatCompletion, Choice, ResultRecord, Usage, keys
from schemas.store import read_result, write_result


def succeeded_record(job_id, batch_id, custom_id, text) -> ResultRecord:
    completion = ChatCompletion(
        id="chatcmpl-x",
        created=1,
        model="m",
        choices=[Choice(message=AssistantMessage(content=text), finish_reason="stop")],
        usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )
    return ResultRecord(
        job_id=job_id,
        batch_id=batch_id,
        custom_id=custom_id,
        status="succeeded",
        response=completion,
        finished_at=2.0,
    )


def test_first_write_wins_and_counts_once(conn):
    assert write_result(conn, succeeded_record("b-1", "b", "c", "first"), 100)
    assert not write_result(conn, succeeded_record("b-1", "b", "c", "second"), 100)
    assert read_result(conn, "b-1").response.choices[0].message.content == "first"
    assert conn.hget(keys.batch_key("b"), "succeeded") == b"1"
    assert conn.lrange(keys.batch_done_key("b"), 0, -1) == [b"b-1"]
    assert 0 < conn.ttl(keys.result_key("b-1")) <= 100
