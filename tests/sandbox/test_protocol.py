"""The /run_code contract: SandboxFusion's status rules, and reading a SandboxFusion deployment's answers."""

from __future__ import annotations

import pytest

from reinforge.sandbox.protocol import (
    MIN_MEMORY_MB,
    CommandRunResult,
    RequestError,
    RunCodeRequest,
    RunCodeResponse,
)


@pytest.mark.parametrize(("run", "status"), [
    (CommandRunResult("Finished", 0.1, 0, "ok", ""), "Success"),
    (CommandRunResult("Finished", 0.1, 1, "", "Traceback"), "Failed"),
    (CommandRunResult("TimeLimitExceeded", 10.0, None, "", ""), "Failed"),
    (CommandRunResult("Error", None, None, None, "cannot start"), "SandboxError"),
])
def test_response_status_follows_sandboxfusion(run, status):
    response = RunCodeResponse.from_run(run)
    assert response.status == status
    assert response.message == ("cannot start" if status == "SandboxError" else "")


def test_reads_a_sandboxfusion_answer_with_its_extra_keys():
    body = {"status": "Success", "message": "", "compile_result": None, "executor_pod_name": None, "files": {},
            "run_result": {"status": "Finished", "execution_time": 0.016, "return_code": 0, "stdout": "42\n",
                           "stderr": ""}}
    response = RunCodeResponse.from_json(body)
    assert response.run_result == CommandRunResult("Finished", 0.016, 0, "42\n", "")
    assert response.to_json() == {key: value for key, value in body.items() if key != "executor_pod_name"}


def test_request_defaults_are_sandboxfusions():
    request = RunCodeRequest.from_json({"code": "print(1)", "language": "python", "stdin": None})
    assert (request.compile_timeout, request.run_timeout, request.memory_limit_MB, request.files) == (10.0, 10.0, -1, {})


@pytest.mark.parametrize("memory_limit", [1, 10, MIN_MEMORY_MB - 1, MIN_MEMORY_MB - 0.5])
def test_a_memory_limit_too_small_to_start_a_program_is_refused_naming_it_and_the_least(memory_limit):
    with pytest.raises(RequestError) as error:
        RunCodeRequest.from_json({"code": "print(1)", "language": "python", "memory_limit_MB": memory_limit})
    assert str(error.value) == (f"memory_limit_MB={int(memory_limit)} is too little for a program to start (python3 "
                                f"needs about 14 MB); send at least {MIN_MEMORY_MB}, or -1 for the server's default")


@pytest.mark.parametrize("memory_limit", [-1, 0, None, MIN_MEMORY_MB, 8192])
def test_the_server_default_and_limits_from_the_least_up_are_accepted(memory_limit):
    request = RunCodeRequest.from_json({"code": "print(1)", "language": "python", "memory_limit_MB": memory_limit})
    assert request.memory_limit_MB == (-1 if memory_limit is None else memory_limit)


def test_fetch_files_is_refused_not_ignored():
    with pytest.raises(RequestError, match="fetch_files is not supported"):
        RunCodeRequest.from_json({"code": "x", "language": "python", "fetch_files": ["out.txt"]})


def test_file_paths_are_normalised_and_kept_inside():
    request = RunCodeRequest.from_json({"code": "x", "language": "python", "files": {"a/./b.txt": "aGk=", "c": None,
                                                                                   "wrapped": "aGVs\nbG8=\n"}})
    assert request.decoded_files() == {"a/b.txt": b"hi", "wrapped": b"hello"}
    for bad in ("/abs", "..", "a/../../b", "", "."):
        with pytest.raises(RequestError):
            RunCodeRequest.from_json({"code": "x", "language": "python", "files": {bad: "aGk="}})
