"""The checks of a request's model options that every way into the model makes (the server's
admission, the bulk embedder): Matryoshka dimensions, the token limit, the prompt."""
from __future__ import annotations

from pollen.common.errors import echo, invalid
from pollen.common.model_spec import MIN_MATRYOSHKA_DIMS, ModelSpec
from pollen.server.tokenizer import PROMPT_MAX_CHARS, TextTokenizer


class ModelChecks:
    def __init__(self, spec: ModelSpec, tokenizer: TextTokenizer):
        self.spec = spec
        self.tokenizer = tokenizer
        self.prompts = dict(spec.prompts)

    def allowed_dimensions(self) -> str:
        if self.spec.matryoshka_dimensions:
            return "one of " + ", ".join(map(str, self.spec.matryoshka_dimensions))
        return f"from {MIN_MATRYOSHKA_DIMS} to {self.spec.hidden_size}"

    def check_dimensions(self, dimensions: int) -> None:
        if dimensions == 0 or dimensions == self.spec.hidden_size:
            return
        sizes = self.spec.matryoshka_dimensions
        ok = dimensions in sizes if sizes else MIN_MATRYOSHKA_DIMS <= dimensions <= self.spec.hidden_size
        if not ok:
            raise invalid(f"dimensions {dimensions} is not offered by this model; allowed: 0 (full size) or "
                          f"{self.allowed_dimensions()}")

    def limit(self, max_tokens: int) -> int:
        if max_tokens > self.spec.max_tokens:
            raise invalid(f"max_tokens {max_tokens} is over the model's limit of {self.spec.max_tokens}")
        if max_tokens and max_tokens <= self.tokenizer.special:
            raise invalid(f"max_tokens {max_tokens} leaves no room for text beside the model's "
                          f"{self.tokenizer.special} special tokens")
        return max_tokens or self.spec.max_tokens

    def prompt(self, prompt_name: str, prompt: str, limit: int) -> str:
        """The prompt to prepend (named, literal or the model's default), checked to be at most
        PROMPT_MAX_CHARS characters and to leave room for text under `limit`: it is tokenized
        with every text (server/tokenizer.py), so its size multiplies by the request's texts."""
        if prompt_name and prompt:
            raise invalid("set either prompt_name or prompt, not both")
        field = "prompt"
        if not prompt:
            named = prompt_name or self.spec.default_prompt_name
            if not named:
                return ""
            if named not in self.prompts:
                known = ", ".join(sorted(self.prompts)) if self.prompts else "none (the model defines no prompts)"
                raise invalid(f"prompt_name {echo(named)} is not one of the model's prompts; known: {known}")
            prompt = self.prompts[named]
            field = f"prompt_name {echo(named)}" if prompt_name else f"the default prompt_name {echo(named)}"
        if len(prompt) > PROMPT_MAX_CHARS:
            raise invalid(f"{field} has {len(prompt)} characters, over the limit of {PROMPT_MAX_CHARS} "
                          "(the prompt is tokenized with every text)")
        tokens = self.tokenizer.prompt_tokens(prompt)
        if tokens >= self.tokenizer.room(limit):
            raise invalid(f"{field} has {tokens} tokens, which leave no room for text under "
                          f"{self.tokenizer.limit_name(limit)} ({self.tokenizer.special} of it for special tokens)")
        return prompt
