"""docs/migrating.md: every field of the reference worker's form does here what the page says.

The page's two tables (the form of runpod-workers/worker-vllm at v2.25.2, and the fields of
its earlier versions) say for each field what it becomes; each row is rebuilt here from the
start the worker makes of that field alone (:func:`tests.launches.launch_of`, the packaged
catalog of vLLM 0.32):

* a flag (`` `--tokenizer` ``): the field sets that flag, and the command credits it;
* ``worker setting``: one of the worker's settings, never a flag;
* ``vLLM's environment``: no flag, no setting, and it reaches vLLM's process;
* ``warning``: the start warns, naming the field and the names the row's notes give;
* ``ignored``: no flag, no setting and no warning (nothing to replace it with).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from tests import docs
from tests.launches import CATALOG, launch_of
from worker.config.command import ALIASES, RETIRED
from worker.config.resolved import Launch
from worker.config.settings import WORKER_SETTING_NAMES

PAGE = "migrating.md"
#: The fields of the reference's form at v2.25.2 (its .runpod/hub.json).
REFERENCE_FORM_FIELDS = 60


@dataclass(frozen=True)
class Row:
    field: str
    here: str
    notes: str

    def __str__(self) -> str:
        return self.field


def rows(marker: str) -> list[Row]:
    text = docs.page(PAGE)
    table = text.split(f"<!-- {marker}:start -->", 1)[1].split(f"<!-- {marker}:end -->", 1)[0]
    return [Row(cells[0].strip("`"), cells[1], cells[2] if len(cells) > 2 else "")
            for cells in docs.table_rows(table, "| Field | Here |")]


REFERENCE_FORM = rows("reference-form")
EARLIER_FORMS = rows("earlier-form")


def test_the_tables_hold_the_whole_form_once() -> None:
    assert len(REFERENCE_FORM) == REFERENCE_FORM_FIELDS
    fields = [row.field for row in REFERENCE_FORM + EARLIER_FORMS]
    assert len(fields) == len(set(fields))
    assert {"SPECULATIVE_METHOD", "NGRAM_PROMPT_LOOKUP_MAX", "RAW_OPENAI_OUTPUT"} <= set(fields)


def sample(field: str) -> str:
    """A value the field's flag takes (the start is only built, never run)."""
    flag = CATALOG.by_env_name(field)
    if flag is not None and flag.kind != "value":
        return "true"
    if flag is not None and flag.choices:
        return flag.choices[-1]
    return "2"


def start_with(field: str) -> Launch:
    return launch_of({"MODEL_NAME": "org/model", field: sample(field)})


def credited(launch: Launch, field: str) -> list[str]:
    return [flag for flag, source in launch.command.sources.items() if source.var == field]


def warned(launch: Launch, field: str) -> list[str]:
    return [warning for warning in launch.command.warnings if field in warning]


@pytest.mark.parametrize("row", REFERENCE_FORM + EARLIER_FORMS, ids=str)
def test_the_reference_forms_fields_do_what_migrating_says(row: Row) -> None:
    launch = start_with(row.field)
    if row.here.startswith("`--"):
        flag = row.here.strip("`")
        maps_to = ALIASES.get(row.field) or getattr(CATALOG.by_env_name(row.field), "name", None)
        assert maps_to == flag, (row, maps_to)
        assert credited(launch, row.field) == [flag], launch.command.argv
        return
    assert credited(launch, row.field) == [], (row, launch.command.argv)
    if row.here == "worker setting":
        assert row.field in WORKER_SETTING_NAMES
    elif row.here == "vLLM's environment":
        assert row.field not in WORKER_SETTING_NAMES and not warned(launch, row.field)
        assert launch.env[row.field] == sample(row.field)
    elif row.here == "warning":
        warnings = warned(launch, row.field)
        assert warnings, row
        for name in re.findall(r"`([A-Z][A-Z0-9_]{2,})", row.notes):
            assert any(name in warning for warning in warnings), (row, name, warnings)
    elif row.here == "ignored":
        assert row.field not in WORKER_SETTING_NAMES and row.field not in RETIRED
        assert not warned(launch, row.field), row
    else:
        pytest.fail(f"{row}: unknown kind {row.here!r}")
