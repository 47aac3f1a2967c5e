"""CLI: write a Hugging Face-layout checkpoint with seeded random weights (`runtime.synthetic.model`).

python tools/make_tiny_model.py DIR --arch llama|qwen2|mistral --preset tiny|1b|8b
"""

from runtime.synthetic.model import main

if __name__ == "__main__":
    main()
