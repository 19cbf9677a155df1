import inspect, sys, torch
from peft.tuners.lora.layer import ParamWrapper
src = inspect.getsource(ParamWrapper)
i = src.find("def __init__"); print(src[i:i+1500])
i = src.find("def get_delta_weight"); print(src[i:i+2500])
i = src.find("def forward"); print(src[i:i+1500])
