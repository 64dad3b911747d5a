"""The probe table (dspark/trace/probes.py) against the built modules' `.note.stapsdt` notes and
docs/trace.md: every listed probe is in its module with the listed argument count, every dspark
probe a module carries is listed, and the docs show the table as the code has it."""
from __future__ import annotations

import shutil

import pytest

from dspark._ext import probes as serving
from dspark.paths import project_root
from dspark.trace import probes

pytestmark = pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) is not installed")

MODULES = sorted({probe.module for probe in probes.PROBES})


@pytest.mark.parametrize("module", MODULES)
def test_every_listed_probe_is_in_the_built_module(module):
    if not serving.BUILT:
        pytest.skip("dspark was built without <sys/sdt.h>: no probes to list (apt-get install systemtap-sdt-dev)")
    path = probes.module_file(module)
    assert path is not None, f"dspark/_ext/{module}*.so is not built"
    notes = probes.probe_notes(path)
    listed = {p.name: len(p.args) for p in probes.PROBES if p.module == module}
    assert notes == listed, f"{path.name}: the notes say {notes}, the table {listed}"


def test_no_probe_has_more_arguments_than_bpftrace_reads():
    assert max(len(p.args) for p in probes.PROBES) <= probes.MAX_ARGS


def test_the_docs_show_the_table():
    text = (project_root() / "docs" / "trace.md").read_text()
    assert probes.markdown_table() in text, "docs/trace.md: paste `python -m dspark.trace.probes` over its table"


def test_parse_notes_reads_readelf_output():
    out = """
Displaying notes found in: .note.stapsdt
  Owner                Data size 	Description
  stapsdt              0x00000040	NT_STAPSDT (SystemTap probe descriptors)
    Provider: dspark
    Name: step_end
    Location: 0x0000000000012345, Base: 0x0000000000000000, Semaphore: 0x0000000000040010
    Arguments: -8@%rbx -4@$0
  stapsdt              0x00000030	NT_STAPSDT (SystemTap probe descriptors)
    Provider: libc
    Name: setjmp
    Location: 0x1, Base: 0x0, Semaphore: 0x0
    Arguments: 8@%rdi -4@%esi 8@%rax
  stapsdt              0x00000030	NT_STAPSDT (SystemTap probe descriptors)
    Provider: dspark
    Name: noargs
    Location: 0x1, Base: 0x0, Semaphore: 0x2
    Arguments:
"""
    assert probes.parse_notes(out) == {"step_end": 2, "noargs": 0}


def test_the_serving_probes_are_silent_calls_while_nothing_is_attached():
    serving.request_start("m", "dspark", 3)
    serving.request_end("m", "dspark", 4, 2, 0.001, 0.002)
    serving.queue_wait("m", 0.0)
    serving.verify_batch(1, 5, 0.001)
    serving.accept_begin(5)
    serving.spec_round(4, 2, 5)
    serving.stream_begin(3)
    serving.stream_end(3)
    serving.route("router", "gold", "inline", 1, 0.0)
    serving.rollout_step("m", 1, "canary", 10.0)
