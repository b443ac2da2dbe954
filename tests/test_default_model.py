"""The shipped default model: files in place, Python-looking greedy output, parity with HF."""
from __future__ import annotations

import json

import pytest

from pagedserve.default_model_path import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME

PARITY_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):",
    "for i in range(10):",
]
MAX_TOKENS = 48
PYTHON_KEYWORDS = {"return", "if", "for", "def", "else", "in", "while"}


def test_checkpoint_files_are_complete_and_small():
    names = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", "training_summary.json"):
        assert required in names, required
    total_bytes = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir() if p.is_file())
    assert total_bytes < 20 * 2**20
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["_name_or_path"] == DEFAULT_MODEL_NAME
    summary = json.loads((DEFAULT_MODEL_DIR / "training_summary.json").read_text())
    assert summary["served_model_name"] == DEFAULT_MODEL_NAME
    assert summary["held_out_perplexity_bf16"] > 1.0


def test_tokenizer_and_chat_template_load_with_transformers():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    text = "def f(x):\n    return x  # é ✓\n"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "write a loop"}],
                                         tokenize=False, add_generation_prompt=True)
    assert chat.endswith("# assistant:") and "# user: write a loop" in chat


@pytest.fixture(scope="module")
def llm():
    from pagedserve import LLM

    return LLM(model=str(DEFAULT_MODEL_DIR), dtype="float32", kv_cache_memory="64MiB")


def _greedy(llm, prompts):
    from pagedserve import SamplingParams

    return llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)


def test_fibonacci_prompt_continues_as_python(llm):
    text = _greedy(llm, ["def fibonacci(n):"])[0].outputs[0].text
    assert "\n    " in text, repr(text)
    words = set(text.replace("(", " ").replace(")", " ").replace(":", " ").split())
    assert words & PYTHON_KEYWORDS, repr(text)


def test_greedy_tokens_equal_hf_transformers(llm):
    """Every token (EOS included, when it ends the output) is HF's greedy choice after the prompt
    and the tokens before it: by induction, exactly HF's greedy generation (teacher forcing, one
    forward per prompt; see checkpoints.HFGreedyReference)."""
    from transformers import AutoTokenizer

    from checkpoints import HFGreedyReference

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    hf = HFGreedyReference(DEFAULT_MODEL_DIR)
    outputs = _greedy(llm, PARITY_PROMPTS)
    for prompt, out in zip(PARITY_PROMPTS, outputs):
        prompt_ids = tokenizer(prompt).input_ids
        assert list(out.prompt_token_ids) == prompt_ids
        ours = list(out.outputs[0].token_ids)
        ended_by_eos = out.outputs[0].finish_reason == "stop"
        assert len(ours) == MAX_TOKENS or (ended_by_eos and ours[-1] == tokenizer.eos_token_id)
        j = hf.first_divergence(prompt_ids, ours)
        assert j is None, (prompt, j, tokenizer.decode(ours))


def test_serve_without_model_uses_the_default_and_writes_python():
    """What the README's first command does: serve with no --model, ask for a completion."""
    import openai

    from pagedserve.config import EngineConfig
    from pagedserve.server.launcher import ServerThread, build_server

    app, _ = build_server(EngineConfig(kv_cache_memory="64MiB"))
    with ServerThread(app) as st:
        assert st.url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME]
        out = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="def fibonacci(n):", max_tokens=48,
                                        temperature=0)
    text = out.choices[0].text
    assert "\n    " in text
    assert set(text.replace("(", " ").replace(":", " ").split()) & PYTHON_KEYWORDS
