"""An SSE event is one line however odd the generated text: clients split lines on more than
'\\n' (str.splitlines: U+2028, U+0085, \\x1c, \\r ...)."""
import json

from keyacc_ray.serve.ingress import _sse


def test_sse_event_survives_any_line_splitter():
    text = "a\u2028b\u2029c\x85d\x1ce\x1df\x1eg\x0bh\x0ci\rj\nk 東京 🙂"
    event = _sse({"choices": [{"text": text}]})
    assert event.endswith("\n\n")
    lines = event[:-2].splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0][len("data: "):])["choices"][0]["text"] == text
