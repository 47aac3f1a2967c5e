"""CLI: write N seeded random PEFT LoRA adapters for a model dir (`runtime.synthetic.adapters`).

python tools/make_adapters.py MODEL_DIR OUT_DIR --n 8 --ranks 8,16 --targets all [--rslora]
"""

from runtime.synthetic.adapters import main

if __name__ == "__main__":
    main()
