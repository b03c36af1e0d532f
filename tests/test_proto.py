from proto import generate, takeover_pb2


def test_generated_code_matches_proto_files():
    assert generate.stale_files() == []


def test_takeover_messages_round_trip():
    init = takeover_pb2.TakeoverInit(machine_id="m", endpoint="h:1", ca_certificate=b"\x01")
    response = takeover_pb2.TakeoverResponse(
        success=takeover_pb2.TakeoverSuccess(init_message=init, key=b"k" * 32, warnings=["w"])
    )
    parsed = takeover_pb2.TakeoverResponse.FromString(response.SerializeToString())
    assert parsed.WhichOneof("result") == "success"
    assert parsed.success.init_message == init
