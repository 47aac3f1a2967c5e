"""`python -m stages.tokenizer CONFIG.json`: run the tokenizer stage (the launcher writes the config)."""

from runtime.base.actor import stage_main
from stages.tokenizer.actor import TokenizerActor
from stages.tokenizer.config import TokenizerConfig

if __name__ == "__main__":
    stage_main(TokenizerActor, TokenizerConfig)
