#!/usr/bin/env bash
# How the shipped SmolLM2-135M EAGLE-3 head is made on one GPU, in runs of < 10 minutes each:
#   bash bench/train_head.sh data   GGUF RUN            # the target writes prompts and answers
#   bash bench/train_head.sh train  GGUF RUN MINUTES    # train (resumes from RUN/checkpoints)
# and to go on from the shipped head on a second corpus (another seed, so other invented prompts):
#   bash bench/train_head.sh more-data GGUF RUN2; bash bench/train_head.sh more GGUF RUN2 MINUTES
# Stage 3 (the shipped head): a third corpus (seed 2, committed in data/), then both committed corpora,
# answers-only loss, the head in bf16 (about 153k tokens/s on an H100; runs of < 10 minutes resume):
#   bash bench/train_head.sh seed2-data GGUF RUN3; bash bench/train_head.sh stage3 GGUF RUN3 MINUTES
# Stage 4 (the shipped head): a fourth corpus (seed 3, all 50 openers, committed in data/), then the three
# committed corpora in packed rows of 768 tokens (one 8.4-minute run reached 3,425 of the 20,000 steps):
#   bash bench/train_head.sh seed3-data GGUF RUN4; bash bench/train_head.sh stage4 GGUF RUN4 MINUTES
# Stage 5: the stage-4 head with its draft vocabulary grown from 8,192 to 16,384 ids (its own rows kept, the
# next most frequent ids' rows from the target's lm_head), then the three committed corpora as in stage 4:
#   bash bench/train_head.sh stage5 GGUF RUN5 MINUTES
# Stage 4's 8,192-id head with its learning rate annealed (stage 4 stopped near its peak rate; the 16,384-id
# ablation's schedule had mostly run down, and its held-out walk rose from 3.42 to 3.52, card-stage5-vocab16k):
#   bash bench/train_head.sh anneal GGUF RUN MINUTES
# Stage 6: a fifth corpus whose invented prompts also name a subject (--topics, train_data.TOPICS: the corpora
# above spread over the openers' few themes; committed as data/smollm2-135m-selfgen-seed4), then 1,200 steps of
# the stage-4 recipe on all four from the stage-4 head (184 s on an H200):
#   bash bench/train_head.sh seed4-data GGUF RUN6; bash bench/train_head.sh stage6 GGUF RUN6 MINUTES
# Stage 7 (the shipped head): a code corpus (the standard library's documented functions for the target to
# complete, raw text, no chat template: the chat corpora held no code to complete, where the heads accepted
# least; committed as data/smollm2-135m-selfgen-code), then stage 6's recipe for 2,000 steps on the five, the
# code corpus four times over (it is small), from the stage-4 head (294 s on an H200):
#   bash bench/train_head.sh code-data GGUF RUN7; bash bench/train_head.sh stage7 GGUF RUN7 MINUTES
# Stage 8: stage 7's head with its MLP widened from 1,536 to 3,072 units (computing what it computed: the new units'
# down rows start at zero; a fresh 3,072-unit head drafted better than a 1,536-unit one at equal steps,
# train_ablation-layers-*), then stage 7's recipe on the five corpora:
#   bash bench/train_head.sh wide GGUF RUN8 MINUTES
# The EAGLE (full-vocabulary) head, trained once on 14,000 sequences (its card), then on the five corpora as stage 7,
# answers only, packed rows (issue 34's retraining with the EAGLE-3 head's data):
#   bash bench/train_head.sh eagle5 GGUF RUN MINUTES [STEPS]
# The DFLASH drafter's stage 1: the committed seed-0 corpus, 14000 steps of 16 sequences x 64 blocks
# (two runs of ~9 minutes on an H100):
#   bash bench/train_head.sh dflash GGUF RUN MINUTES
# Its stage 3: the stage-2 drafter, 8,000 more steps on the three committed corpora, answers only
# (307 s on an H200; XLA's SKIP_TEMP command-buffer mode off for orbax's saves, as in stage 4 above):
#   bash bench/train_head.sh dflash3 GGUF RUN MINUTES
# Its stage 4 (shipped): stage 3's drafter, 9,000 steps on the five corpora as stage 7 (the code corpus four times
# over; 331 s on an H200):
#   bash bench/train_head.sh dflash4 GGUF RUN MINUTES
# Data and training run in separate processes on purpose (the training step once ran ~60x slower in
# the process that had generated the data; bench/results/train-attempts/).
set -euo pipefail
stage=$1 gguf=$2 run=$3
common=(--model "$gguf" --kind eagle3 --run "$run" --num-prompts 49152 --gen-batch 1024 --max-new-tokens 256
        --seq-len 384 --draft-vocab 8192 --steps 8000 --batch 32 --ttt 6 --lr 1e-3 --save-every 1000
        --log-every 50 --pack-len 0)  # these stages ran one sequence a row (packing came later)
d=data/smollm2-135m-selfgen  # the committed corpora
three=$d-seed0/data.npz,$d-seed2/data.npz,$d-seed3/data.npz
four=$three,$d-seed4/data.npz
code=$d-code/data.npz  # written by code-data into RUN, then committed
five=$four,$code,$code,$code,$code
case $stage in
  data) python -m jaxspec.train "${common[@]}" --data-only ;;
  train) python -m jaxspec.train "${common[@]}" --max-minutes "$4" --export "$run/head" ;;
  more-data) python -m jaxspec.train "${common[@]}" --num-prompts 32768 --seed 1 --data-only ;;
  more) python -m jaxspec.train "${common[@]}" --num-prompts 32768 --seed 1 --steps 4000 --lr 3e-4 \
          --init-from jaxspec/drafters/weights/smollm2-135m-eagle3 --max-minutes "$4" --export "$run/head" ;;
  seed2-data) python -m jaxspec.train "${common[@]}" --num-prompts 36864 --seed 2 --data-only ;;
  stage3) python -m jaxspec.train --model "$gguf" --kind eagle3 --run "$run" --seq-len 384 --batch 32 --ttt 6 \
          --data data/smollm2-135m-selfgen-seed0/data.npz,data/smollm2-135m-selfgen-seed2/data.npz \
          --init-from jaxspec/drafters/weights/smollm2-135m-eagle3 --lr 3e-4 --steps 16000 --loss-on answer --pack-len 0 \
          --save-every 1000 --log-every 50 --max-minutes "$4" --export "$run/head" ;;
  seed3-data) python -m jaxspec.train "${common[@]}" --num-prompts 36864 --seed 3 --data-only ;;
  stage4) python -m jaxspec.train --model "$gguf" --kind eagle3 --run "$run" --seq-len 384 --batch 32 --ttt 6 \
          --data $three \
          --init-from jaxspec/drafters/weights/smollm2-135m-eagle3 --lr 3e-4 --steps 20000 --loss-on answer --pack-len 768 \
          --save-every 1000 --log-every 50 --max-minutes "$4" --export "$run/head" ;;
  stage5) python -m jaxspec.train --model "$gguf" --kind eagle3 --run "$run" --seq-len 384 --batch 32 --ttt 6 \
          --data $three \
          --init-from jaxspec/drafters/weights/smollm2-135m-eagle3 --draft-vocab 16384 --lr 2e-4 --steps 3000 \
          --loss-on answer --pack-len 768 --save-every 1000 --log-every 50 --max-minutes "$4" --export "$run/head" ;;
  anneal) python -m jaxspec.train --model "$gguf" --kind eagle3 --run "$run" --seq-len 384 --batch 32 --ttt 6 \
          --data $three \
          --init-from jaxspec/drafters/weights/smollm2-135m-eagle3 --lr 1.5e-4 --steps 3000 \
          --loss-on answer --pack-len 768 --save-every 1000 --log-every 50 --max-minutes "$4" --export "$run/head" ;;
  dflash) python -m jaxspec.train --model "$gguf" --kind dflash --run "$run" --data data/smollm2-135m-selfgen-seed0/data.npz \
          --seq-len 384 --steps 14000 --batch 16 --anchors 64 --lr 8e-4 --block-size 16 --draft-layers 3 \
          --save-every 500 --log-every 50 --max-minutes "$4" --export "$run/head" ;;
  seed4-data) python -m jaxspec.train "${common[@]}" --num-prompts 36864 --seed 4 --topics --data-only ;;
  stage6) JAXSPEC_CMDBUF_UPDATE_MODE= python -m jaxspec.train --model "$gguf" --kind eagle3 --run "$run" --seq-len 384 --batch 32 \
          --ttt 6 --data $four \
          --init-from jaxspec/drafters/weights/smollm2-135m-eagle3 --lr 2e-4 --steps 1200 --loss-on answer --pack-len 768 \
          --save-every 1000 --log-every 50 --max-minutes "$4" --export "$run/head" ;;
  code-data) python -m jaxspec.train "${common[@]}" --num-prompts 8192 --seed 5 --prompts code --data-only ;;
  stage7) JAXSPEC_CMDBUF_UPDATE_MODE= python -m jaxspec.train --model "$gguf" --kind eagle3 --run "$run" \
          --seq-len 384 --batch 32 --ttt 6 --data $five \
          --init-from jaxspec/drafters/weights/smollm2-135m-eagle3 --lr 2e-4 --steps 2000 --loss-on answer --pack-len 768 \
          --save-every 500 --log-every 50 --max-minutes "$4" --export "$run/head" ;;
  wide) JAXSPEC_CMDBUF_UPDATE_MODE= python -m jaxspec.train --model "$gguf" --kind eagle3 --run "$run" \
          --seq-len 384 --batch 32 --ttt 6 --data $five --intermediate-size 3072 \
          --init-from jaxspec/drafters/weights/smollm2-135m-eagle3 --lr 2e-4 --steps "${5:-1600}" --loss-on answer \
          --pack-len 768 --save-every 400 --log-every 50 --max-minutes "$4" --export "$run/head" ;;
  eagle5) JAXSPEC_CMDBUF_UPDATE_MODE= python -m jaxspec.train --model "$gguf" --kind eagle --run "$run" \
          --seq-len 384 --batch 32 --ttt 6 --data $five \
          --init-from jaxspec/drafters/weights/smollm2-135m-eagle --lr 5e-4 --steps "${5:-3000}" --loss-on answer \
          --pack-len 768 --save-every 500 --log-every 50 --max-minutes "$4" --export "$run/head" ;;
  dflash3) JAXSPEC_CMDBUF_UPDATE_MODE= python -m jaxspec.train --model "$gguf" --kind dflash --run "$run" \
          --data $three \
          --init-from jaxspec/drafters/weights/smollm2-135m-dflash --seq-len 384 --steps 8000 --batch 16 --anchors 64 \
          --lr 3e-4 --block-size 16 --draft-layers 3 --loss-on answer --save-every 1000 --log-every 50 \
          --max-minutes "$4" --export "$run/head" ;;
  dflash4) JAXSPEC_CMDBUF_UPDATE_MODE= python -m jaxspec.train --model "$gguf" --kind dflash --run "$run" \
          --data $five \
          --init-from jaxspec/drafters/weights/smollm2-135m-dflash --seq-len 384 --steps 9000 --batch 16 --anchors 64 \
          --lr 3e-4 --block-size 16 --draft-layers 3 --loss-on answer --save-every 1000 --log-every 50 \
          --max-minutes "$4" --export "$run/head" ;;
  *) echo "stage must be data, train, more-data, more, seed2-data, stage3, seed3-data, stage4, stage5, anneal, seed4-data, stage6, code-data, stage7, wide, eagle5, dflash, dflash3 or dflash4" >&2; exit 2 ;;
esac
