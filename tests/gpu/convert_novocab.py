# llama.cpp's own convert_hf_to_gguf.py, unchanged, with the vocabulary step skipped (the
# fixtures ship no tokenizer; the model classes' metadata and tensors are what is checked).
import runpy, sys
rt = sys.argv[1]
sys.path.insert(0, rt + "/llama.cpp")
sys.path.insert(1, rt + "/llama.cpp/gguf-py")
import conversion.base as b, conversion.deepseek as d, conversion.glm as g, conversion.minimax as m
noop = lambda self: None
for c in (b.TextModel, d.DeepseekV2Model, g.Glm4MoeModel, m.MiniMaxM2Model):
    c.set_vocab = noop
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", sys.argv[4]]
runpy.run_path(rt + "/llama.cpp/convert_hf_to_gguf.py", run_name="__main__")
