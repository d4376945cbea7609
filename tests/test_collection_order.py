"""The suite's collection order (tests/conftest.py): long folders first, the verl step's files in
the order that splits them evenly over its two workers, the short demo last; and every file the
order names exists, so a renamed file cannot drop out of it unnoticed."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import COLLECTED_LAST, VERL_FILE_ORDER, collection_rank

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_the_order_names_exists():
    missing = [name for name in (*VERL_FILE_ORDER, *COLLECTED_LAST) if not (ROOT / name).is_file()]
    assert missing == []


def test_verl_files_go_in_the_named_order_and_the_rest_after_them():
    order = sorted(["tests/verl_backend/test_new.py::t", "tests/verl_backend/test_verl_sft.py::t",
                    "tests/verl_backend/test_verl_gateway_port.py::t", "tests/verl_backend/test_verl_adapters.py::t",
                    "tests/verl_backend/test_verl_update.py::t", "tests/verl_backend/test_verl_apo.py::t"],
                   key=collection_rank)
    assert [nodeid.split("/")[-1].split(".")[0] for nodeid in order] == [
        "test_verl_update", "test_verl_apo", "test_verl_adapters", "test_verl_gateway_port", "test_verl_sft",
        "test_new"]


def test_folders_keep_their_place_before_file_order():
    nodeids = ["tests/test_cli_errors.py::t", "tests/loop/test_loop_demo_short.py::t", "tests/loop/test_x.py::t",
               "tests/trainer_bridge/test_y.py::t", "tests/verl_backend/test_verl_adapters.py::t"]
    assert sorted(nodeids, key=collection_rank) == [
        "tests/loop/test_x.py::t", "tests/trainer_bridge/test_y.py::t", "tests/verl_backend/test_verl_adapters.py::t",
        "tests/test_cli_errors.py::t", "tests/loop/test_loop_demo_short.py::t"]
