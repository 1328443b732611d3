"""`infinigen serve`: an OpenAI-compatible server (FastAPI) over a continuous-batching engine.

    engine = Engine(model, policy, placement)   # infinigen.serve.engine
    app = create_app(engine, tokenizer, name)   # infinigen.serve.app
"""
