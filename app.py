"""KVScope: `python app.py` (also the Hugging Face Spaces entry point); the explorer's main() is in kvscope/app/main.py."""

from kvscope.app.main import main

if __name__ == "__main__":
    main()
