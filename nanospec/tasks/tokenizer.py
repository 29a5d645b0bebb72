"""A word-level tokenizer for the embedded task, wrapped as a real HF `PreTrainedTokenizerFast`.

Why word-level: every word of the synthetic task is one token (digits, step labels, `;`, `=`), so a
response of k steps is exactly 4k+2 tokens and the length tail is visible in token counts. Why a real
HF tokenizer: the engine, the trainer and the tests then use one code path (`save_pretrained`,
`AutoTokenizer.from_pretrained`, `apply_chat_template`) for this toy and for a real Qwen3 checkpoint.

Chat template (roles are added special tokens, so they split out even without spaces):
    <s><user> a 3 b 7 ?<assistant>       <- prompt with add_generation_prompt=True
    ... completion ... </s>              <- the model ends its turn with eos
"""
from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<system>", "<user>", "<assistant>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<' + m['role'] + '> ' + m['content'] + ' ' }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)


def build_tiny_vocab_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """Whitespace-split word-level tokenizer over `words` (ids 7..) after the 7 special tokens (ids 0..6).

    Usable for any small vocabulary, e.g. the 8-word models of the engine's exactness tests.
    """
    words = list(dict.fromkeys(words))  # dedupe, keep order
    bad = [w for w in words if not w or any(c.isspace() for c in w) or w in SPECIAL]
    if bad:
        raise ValueError(f"tokenizer words must be non-empty, contain no whitespace and not be special "
                         f"tokens {SPECIAL}; got {bad}")
    vocab = {w: i for i, w in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=SPECIAL[4:], clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The embedded task's tokenizer: its vocabulary (see synthetic.VOCAB)."""
    from nanospec.tasks.synthetic import VOCAB
    return build_tiny_vocab_tokenizer(VOCAB)


def format_prompt(tokenizer, prompt: str | list[dict], **template_kwargs) -> list[int]:
    """Token ids of a prompt + the generation prompt (what `LLM.chat` feeds): a string is one user
    turn, a list of {role, content} messages goes to the chat template as it is."""
    from nanospec.models.loader import chat_prompt_ids
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return chat_prompt_ids(tokenizer, messages, **template_kwargs)


def longest_prompt(tokenizer, problems, max_model_len: int) -> int:
    """The longest prompt of `problems` in tokens; a ValueError naming the first one that leaves no
    room for a completion within `max_model_len` (a rollout would fail on it mid-run)."""
    longest = 0
    for p in problems:
        n = len(format_prompt(tokenizer, p.messages or p.prompt))
        if n >= max_model_len:
            where = p.meta.get("row") or repr(p.prompt[:60])
            raise ValueError(f"task: the prompt of {where} has {n} tokens; the model's max_model_len "
                             f"(max_position_embeddings) is {max_model_len}")
        longest = max(longest, n)
    return longest
