"""How the Ray pool words a replica's death (integrations/ray/calls.py):
without a Ray cluster."""
from __future__ import annotations

from integrations.ray.calls import _why


class _Died(Exception):
    pass


def test_a_death_names_the_constructors_error_and_its_first_cause():
    chained = _Died("""The actor died because of an error raised in its creation task, ray::Replica.__init__()
Traceback (most recent call last):
  File "x.py", line 3, in <module>
ModuleNotFoundError: No module named 'sentencepiece'
The above exception was the direct cause of the following exception:
ModuleNotFoundError: Could not import module 'LlamaConfig'. Are this object's requirements defined correctly?""")
    assert _why(chained) == ("ModuleNotFoundError: Could not import module 'LlamaConfig'. Are this object's "
                             "requirements defined correctly? (caused by ModuleNotFoundError: No module named "
                             "'sentencepiece')")
    assert _why(_Died("ray::Replica.__init__()\nValueError: max_total_tokens must be positive")) == \
        "ValueError: max_total_tokens must be positive"
    assert _why(_Died("the node was lost")) == "the node was lost"
    assert _why(_Died("")) == "_Died"
