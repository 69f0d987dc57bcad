"""`python -m demos.real` (`make demo-real`): the draft recipe on SmolLM2-135M-Instruct end to end (demos/real/recipe.py)."""
from .recipe import main

if __name__ == "__main__":
    main()
