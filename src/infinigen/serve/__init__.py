"""`infinigen serve`: an OpenAI-compatible server (FastAPI) over a continuous-batching engine.

    engine = Engine(model, policy, placement)   # infinigen.serve.engine (or Engine.from_config)
    app = create_app(engine, tokenizer, name)   # infinigen.serve.app; the routes: infinigen.serve.routes
    config = ServerConfig(max_batch=8)          # infinigen.serve.config: every `infinigen serve` option
"""
