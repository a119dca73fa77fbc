from setuptools import find_packages, setup

version = {}
exec(open("optimum_ipex_spec/version.py").read(), version)

# The IPEX lane pins an exact, validated set: IPEX X.Y imports only next to torch X.Y.*, and
# IPEX 2.8's ipex.llm.optimize fails with transformers >= 4.52 (see docs/setup.md, "Version lanes").
IPEX_LANE = ["torch==2.8.0", "intel-extension-for-pytorch==2.8.0", "transformers==4.51.3"]
# IPEX 2.7 imports pkg_resources, which setuptools >= 81 no longer ships
IPEX27_LANE = ["torch==2.7.1", "intel-extension-for-pytorch==2.7.0", "transformers==4.48.0", "setuptools<81"]
TESTS = ["pytest>=8", "parameterized>=0.9", "gguf>=0.10", "sentencepiece", "pyyaml"]

setup(
    name="optimum-ipex-spec",
    version=version["__version__"],
    description="Fast causal-LM generation and lossless speculative decoding on Intel CPUs with IPEX, Optimum-style.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # optimum.commands.register is optimum's PEP 420 plugin namespace (no __init__.py): it registers
    # `optimum-cli export ipex`.
    packages=find_packages(include=["optimum_ipex_spec", "optimum_ipex_spec.*"]) + ["optimum.commands.register"],
    # the C++ kernels, built at their first use (torch.utils.cpp_extension)
    package_data={"optimum_ipex_spec.kernels": ["csrc/*.cpp", "csrc/*.h"]},
    python_requires=">=3.9",
    install_requires=[
        "torch",  # any build; the lanes below pin exact versions
        "transformers>=4.48",
        "optimum>=2.0",
        "safetensors",
        "tqdm",
        "packaging",
        "gguf>=0.10",
        "accelerate",  # transformers' from_pretrained(..., gguf_file=...) (model provisioning) requires it
    ],
    extras_require={
        "ipex": IPEX_LANE,
        "ipex27": IPEX27_LANE,
        "tests": TESTS,
    },
    entry_points={
        "console_scripts": ["optimum-ipex-spec-provision=optimum_ipex_spec.provisioning.provision:main"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
