// Drives `consumer board` in a real Chromium (Debian's, headless), as an operator would:
// the overview groups the dead letters, one letter opens whole, a group is replayed after
// its confirmation page. Run by consumer-cli/tests/board.rs:
//
//   node board.mjs BOARD_URL [SCREENSHOT_PATH]
//
// Exits 1 with the reason if the page does not show or do what it should.
import { chromium } from 'playwright-core';

const [url, screenshot] = process.argv.slice(2);
const fail = (why) => {
  throw new Error(why);
};

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
  headless: true,
  // Root in CI: Chromium's sandbox needs a user namespace it does not get there.
  args: ['--no-sandbox'],
});
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 860 } });
  await page.goto(url);
  const group = (reason) => page.locator('#groups-0 tbody tr', { hasText: reason });
  const rejected = group('permanent_error');
  const count = (await rejected.locator('.count').innerText()).trim();
  if (count !== '3') fail(`the permanent_error group counts ${count}, not 3`);
  const fingerprint = await rejected.locator('td').nth(3).innerText();
  if (!fingerprint.includes('order # rejected by the provider')) {
    fail(`the group's fingerprint is ${JSON.stringify(fingerprint)}`);
  }
  const flaky = (await group('max_attempts_exceeded').locator('.count').innerText()).trim();
  if (flaky !== '2') fail(`the max_attempts_exceeded group counts ${flaky}, not 2`);
  if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });

  // One letter, whole: its payload holds its id.
  const first = rejected.locator('td a').first();
  const id = (await first.innerText()).trim();
  await first.click();
  const payload = await page.locator('#payload').innerText();
  if (!payload.includes(id)) fail(`the letter ${id}'s payload is ${JSON.stringify(payload)}`);
  await page.goBack();

  // Replay the group, after its confirmation.
  await group('permanent_error').getByText('Replay group').click();
  const what = await page.locator('#what').innerText();
  if (what !== 'Replay 3 dead letters?') fail(`the confirmation asks ${JSON.stringify(what)}`);
  await page.locator('#confirm').click();
  const result = await page.locator('#result').innerText();
  if (!result.includes('replayed 3') || !result.includes('failed 0')) {
    fail(`the replay reports ${JSON.stringify(result)}`);
  }
  console.log(`board: ${result}`);
} catch (e) {
  console.error(`board: ${e.message}`);
  process.exitCode = 1;
} finally {
  await browser.close();
}
