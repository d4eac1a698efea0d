"""KVScope: `python app.py` (also the Hugging Face Spaces entry point); the explorer's main() is in app/main.py."""

from app.main import main

if __name__ == "__main__":
    main()
