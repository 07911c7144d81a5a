import setuptools

setuptools.setup(
    name='speculative_t5x',
    version='0.1.0',
    description='Exact speculative decoding and the Big Little Decoder for T5 in JAX/Flax, T5X-native.',
    # The gin configs live beside the package (gin_configs/, as in T5X) and ship inside it as
    # speculative_t5x/gin_configs: the wheel's commands find them there from any directory, and
    # T5X's gin reads 'speculative_t5x/gin_configs/t5x/...' through the Python path (both in an
    # installed wheel and in an editable install, whose import hook follows package_dir).
    packages=(setuptools.find_packages(include=['speculative_t5x', 'speculative_t5x.*']) +
              ['speculative_t5x.gin_configs'] +
              [f'speculative_t5x.gin_configs.{name}'
               for name in setuptools.find_packages('gin_configs')]),
    package_dir={'speculative_t5x.gin_configs': 'gin_configs'},
    # The embedded model pair, its vocabulary, the gin configs and the caption sample: the
    # commands the README prints need them from an installed wheel too (tests/test_packaging.py).
    package_data={'speculative_t5x': ['pretrained/*.msgpack', 'pretrained/*.json', 'vocab/*.model', 'samples/*.txt'],
                  'speculative_t5x.gin_configs': ['**/*.gin']},
    entry_points={'console_scripts': [
        'speculative-t5x-translate = speculative_t5x.translate:main',
        'speculative-t5x-infer = speculative_t5x.infer:run',
        'speculative-t5x-train = speculative_t5x.train:run',
        'speculative-t5x-calibrate = speculative_t5x.calibrate:run',
    ]},
    python_requires='>=3.10',
    install_requires=[
        'jax>=0.4.30',
        'jaxlib>=0.4.30',
        'flax>=0.8.0',
        'optax>=0.2.8',  # optax.tree.norm (tested with 0.2.8)
        'gin-config>=0.5.0',
        'orbax-checkpoint>=0.5.0',
        'tensorstore>=0.1.60',
        'sentencepiece>=0.1.99',
        'msgpack>=1.0',
        'numpy>=1.24',
        'ml_dtypes>=0.2',
        'absl-py>=1.0',
        'tqdm>=4.60',
    ],
    extras_require={
        # torch==2.13.0: the CPU build this project's machines install from a local file
        # (any other torch resolves to a multi-GB CUDA build here); transformers >= 5 for the
        # HF parity and assisted-generation tests; ctranslate2 for benchmarks.vs_ctranslate2's.
        'test': ['pytest>=7.0', 'pytest-xdist>=3.0', 'scipy>=1.10', 'sacrebleu>=2.0', 'torch==2.13.0',
                 'transformers>=5.0', 'ctranslate2>=4.8.5'],
        # seqio tasks (imports TensorFlow; the core modules never do) and BLEU.
        'data': ['seqio>=0.0.18', 'tensorflow-cpu>=2.13', 'sacrebleu>=2.0'],
        # Hugging Face folders: safetensors are read without these; pytorch_model.bin needs
        # torch, and the logit-parity tests build models with transformers.
        'hf': ['torch>=2.0', 'transformers>=4.30'],
        # benchmarks/ (python -m benchmarks.speed): BLEU, and HF assisted generation
        # (transformers 5 API); benchmarks.vs_ctranslate2: CTranslate2 (4.8.5 tested; its T5
        # converter needs torch and transformers). torch pinned as in 'test': a range would take
        # a multi-GB CUDA build on the project's machines.
        'bench': ['sacrebleu>=2.0', 'torch==2.13.0', 'transformers>=5.0', 'ctranslate2>=4.8.5'],
    },
)
