// Run an exported msa_fed combined model from Node.js with onnxruntime-node alone.
//
//   npm install onnxruntime-node        (ONNXRUNTIME_NODE_INSTALL=skip: CPU only, nothing downloaded)
//   node predict.js model.onnx batch.json [--float32]
//
// batch.json holds {"X": [[x_1, ..., x_d], ...]}; the model's outputs are printed as JSON by name:
// probabilities and label (classification) or prediction (regression).  --float32 for a model
// exported with --dtype float32.
'use strict';
const fs = require('fs');
const ort = require('onnxruntime-node');

async function main(argv) {
  const args = argv.filter((a) => !a.startsWith('--'));
  if (args.length !== 2) {
    console.error('usage: node predict.js model.onnx batch.json [--float32]');
    return 2;
  }
  const [modelPath, batchPath] = args;
  const float32 = argv.includes('--float32');
  const rows = JSON.parse(fs.readFileSync(batchPath, 'utf8')).X;
  if (!Array.isArray(rows) || rows.length === 0 || !rows.every((r) => Array.isArray(r) && r.length === rows[0].length)) {
    console.error('error: the batch must be {"X": [[...], ...]} with rows of equal length');
    return 1;
  }
  const flat = rows.flat();
  if (!flat.every((v) => typeof v === 'number' && Number.isFinite(v))) {
    console.error('error: every value must be a finite number');
    return 1;
  }
  const session = await ort.InferenceSession.create(modelPath);
  const data = float32 ? Float32Array.from(flat) : Float64Array.from(flat);
  const X = new ort.Tensor(float32 ? 'float32' : 'float64', data, [rows.length, rows[0].length]);
  const results = await session.run({ [session.inputNames[0]]: X });
  const out = {};
  for (const name of session.outputNames) {
    const t = results[name];
    const values = Array.from(t.data, (v) => (typeof v === 'bigint' ? Number(v) : v));
    const width = t.dims.length === 2 ? t.dims[1] : 0;
    out[name] = width ? rows.map((_, i) => values.slice(i * width, (i + 1) * width)) : values;
  }
  process.stdout.write(JSON.stringify(out) + '\n');
  return 0;
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (err) => {
    console.error(`error: ${err.message}`);
    process.exit(1);
  },
);
