"""The bundled default model: loadable by transformers as it is, token-exact with it under ferry, and
a golden test of three greedy completions."""

import subprocess
import sys

import pytest
import torch

from ferry import LLM, SamplingParams
from ferry.assets import default_draft_model_path, default_model_path

transformers = pytest.importorskip("transformers")

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]

# Greedy, float32, 32 tokens: what the shipped weights produce. A change here means the model, the
# tokenizer or the engine changed behaviour.
GOLDEN = [
    '\n    """Adapter to use a rounding mode.\n\n    If the rounding mode is given, it is used as a rounding mode.\n   ',
    "import sys\nimport sysconfig\nimport tempfile\nimport tempfile\nimport tempfile\nimport tempfile\n"
    "import tempfile\nimport tempfile\nimport tempfile\nimport tempfile\nimport tempfile",
    "\n    pass\n\nclass Stack:\n    pass\n\nclass Stack:\n    pass\n\nclass Stack:\n    pass\n\nclass Stack:",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")


def test_golden_completions(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == GOLDEN


@pytest.mark.parametrize("path_of", [default_model_path, default_draft_model_path], ids=["main", "draft"])
def test_transformers_loads_it_and_agrees_with_ferry(path_of):
    path = path_of()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, dtype="float32")
    chat = [{"role": "user", "content": "What does os.path.join do?"}]
    prompts = PROMPTS + [hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)]
    for prompt in prompts:
        ids = hf_tokenizer(prompt, add_special_tokens=not prompt.startswith("<|bos|>"))["input_ids"]
        with torch.no_grad():
            hf_out = hf_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
        ours = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
        assert ours[0].outputs[0].token_ids == hf_out
    assert llm.tokenizer.encode(PROMPTS[0]) == hf_tokenizer(PROMPTS[0])["input_ids"]
    assert llm.tokenizer.apply_chat_template(chat) == prompts[-1]


def test_ferry_generate_needs_no_flag():
    out = subprocess.run(
        [sys.executable, "-m", "ferry", "generate", "def fibonacci(n):", "--max-tokens", "16"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def fibonacci(n):") and len(out.stdout) > len("def fibonacci(n):") + 5
