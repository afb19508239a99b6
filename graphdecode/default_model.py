"""The built-in default model: a small random Llama with a real tokenizer, made offline.

Created deterministically on first use (fixed corpus for the byte-level BPE
tokenizer, fixed torch seed for the weights) and saved with transformers
`save_pretrained` as a normal HuggingFace directory (config.json + safetensors +
tokenizer), so `graphdecode generate` works on a machine with no network. Its text is
gibberish: it exists to exercise the engine, not to be read.
"""

from __future__ import annotations

from .cache import cached_model_dir

DEFAULT_MODEL_NAME = "default-llama-v2"  # v2: ships a chat template

# A plain chat template (the model is random, the format only has to be well-formed):
# each message is "<s>role\ncontent</s>\n"; a generation prompt opens "<s>assistant\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

_CORPUS = """\
graphdecode is a decode engine for large language models. It captures one CUDA graph per batch bucket,
and each graph runs several decode steps back to back: the model forward, sampling, and a kernel that
prepares the next step's inputs. The scheduler only decides admissions between graph launches.
The capital of France is Paris. The capital of Italy is Rome. The capital of Japan is Tokyo.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Once upon a time there was a little engine that wanted to go fast. It learned to keep the GPU busy,
to never wait for Python, and to count every token it produced. One, two, three, four, five, six,
seven, eight, nine, ten. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
def main():\n    print("hello, world")\n    return 0\n
"""


def default_model_dir() -> str:
    return cached_model_dir(DEFAULT_MODEL_NAME, build_default_model)


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_random_model(path: str, config, seed: int = 0) -> None:
    """A transformers model with deterministic random weights, saved with save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)


def build_default_model(path: str) -> None:
    from transformers import LlamaConfig

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,
    )
    save_random_model(path, config, seed=0)
    tokenizer.save_pretrained(path)
