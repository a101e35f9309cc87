// The check scripts/asyncapi-check.sh runs:
//   node asyncapi-check.mjs <tools> <document> [<message> <payload.json>]...
// The document must parse and validate with no error, each message's examples
// must match its payload schema, and so must each payload file given with the
// name of a message of the document's components.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";

const [tools, file, ...payloads] = process.argv.slice(2);
if (payloads.length % 2 !== 0) {
  console.error("usage: asyncapi-check.mjs <tools> <document> [<message> <payload.json>]...");
  process.exit(2);
}
const require = createRequire(`${tools}/node_modules/`);
const { Parser, fromFile } = require("@asyncapi/parser");
// The JSON Schema validator the parser itself runs on.
const Ajv = require("ajv");
const addFormats = require("ajv-formats");

const { document, diagnostics } = await fromFile(new Parser(), file).parse();
const severities = ["error", "warning", "information", "hint"];
for (const d of diagnostics) {
  console.error(`${file}: ${severities[d.severity]}: ${d.message} (at ${d.path.join(".") || "the top"})`);
}
let errors = diagnostics.filter((d) => d.severity === 0).length;
if (!document) {
  console.error(`asyncapi-check: FAILED: ${file} does not parse`);
  process.exit(1);
}

const ajv = new Ajv({ allErrors: true, strict: false });
addFormats(ajv);
function check(what, schema, value) {
  if (!schema || schema.type === undefined) return; // opaque bytes
  const validate = ajv.compile(schema);
  if (!validate(value)) {
    errors += 1;
    console.error(`${file}: error: ${what} does not match its schema: ${ajv.errorsText(validate.errors)}`);
  }
}
const messages = document.components().messages();
for (const message of messages) {
  const schema = message.payload()?.json();
  for (const example of message.examples()) {
    check(`example "${example.name()}" of ${message.id()}`, schema, example.payload());
  }
}
for (let i = 0; i + 1 < payloads.length; i += 2) {
  const [name, path] = [payloads[i], payloads[i + 1]];
  const message = messages.get(name);
  if (!message) {
    errors += 1;
    console.error(`${file}: error: no message ${name}`);
    continue;
  }
  check(`${path}`, message.payload()?.json(), JSON.parse(readFileSync(path, "utf8")));
}
if (errors > 0) {
  console.error(`asyncapi-check: FAILED: ${file}: ${errors} error(s)`);
  process.exit(1);
}
console.log(`asyncapi-check: ${file} is valid AsyncAPI ${document.version()}`);
